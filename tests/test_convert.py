"""Converter: HF safetensors -> NVFP4 ModelOpt layout, identical to the trainer's QDQ; live sync."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quads_megatron import checkpoint, fake_quant, nvfp4
from quads_megatron.checkpoint import ConvertError, ConvertOptions
from quads_megatron.checkpoint import output as convert_output
from quads_megatron.cli import main as cli_main

H, F, E, L = 32, 48, 4, 2


def hf_moe_state(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(50, H, generator=g).bfloat16()}
    for layer in range(L):
        p = f"model.layers.{layer}"
        sd[f"{p}.self_attn.q_proj.weight"] = torch.randn(H, H, generator=g).bfloat16()
        sd[f"{p}.mlp.gate.weight"] = torch.randn(E, H, generator=g).bfloat16()
        for e in range(E):
            scale = 0.02 * (e + 1)
            sd[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (torch.randn(F, H, generator=g) * scale).bfloat16()
            sd[f"{p}.mlp.experts.{e}.up_proj.weight"] = (torch.randn(F, H, generator=g) * scale * 3).bfloat16()
            sd[f"{p}.mlp.experts.{e}.down_proj.weight"] = (torch.randn(H, F, generator=g) * scale).bfloat16()
    sd["lm_head.weight"] = torch.randn(50, H, generator=g).bfloat16()
    return sd


def write_hf(path, sd, shards=2):
    os.makedirs(path, exist_ok=True)
    names = list(sd)
    if shards == 2:  # split so that layer 0 expert 1's gate and up land in different shards
        cut = names.index("model.layers.0.mlp.experts.1.up_proj.weight")
        parts = [names[:cut], names[cut:]]
    else:
        parts = [names]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({n: sd[n] for n in part}, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, checkpoint.INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3_moe", "hidden_size": H}, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write("{}")
    return path


def read_all(path) -> dict[str, torch.Tensor]:
    with open(os.path.join(path, checkpoint.INDEX)) as f:
        wm = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(wm.values())):
        with safe_open(os.path.join(path, shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def dq(out, mod):
    return nvfp4.dequantize(
        nvfp4.from_modelopt(out[f"{mod}.weight"], out[f"{mod}.weight_scale"], out[f"{mod}.weight_scale_2"]),
        torch.bfloat16,
    )


def test_converted_experts_equal_trainer_qdq_bit_for_bit(tmp_path):
    sd = hf_moe_state()
    src = write_hf(tmp_path / "hf", sd)
    summary = checkpoint.convert_hf(str(src), str(tmp_path / "nvfp4"), ConvertOptions(verify=True, progress=False))
    assert summary["quantized_modules"] == L * E * 3
    out = read_all(tmp_path / "nvfp4")
    spec = fake_quant.FakeQuantSpec()
    for layer in range(L):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            fc1 = torch.cat([sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"]])  # Megatron's fused fc1
            want_fc1 = fake_quant.qdq_weight(fc1, spec)  # what the QAT trainer uses in forward
            got_fc1 = torch.cat([dq(out, f"{p}.gate_proj"), dq(out, f"{p}.up_proj")])
            assert torch.equal(got_fc1, want_fc1), p
            assert torch.equal(dq(out, f"{p}.down_proj"), fake_quant.qdq_weight(sd[f"{p}.down_proj.weight"], spec))
            assert out[f"{p}.gate_proj.weight_scale_2"].item() == out[f"{p}.up_proj.weight_scale_2"].item()
            assert out[f"{p}.gate_proj.weight"].dtype == torch.uint8
            assert out[f"{p}.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert torch.equal(out[name], sd[name])  # non-experts untouched
    hq = json.loads((tmp_path / "nvfp4" / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16
    assert "lm_head" in hq["quantization"]["exclude_modules"]
    assert "model.layers.0.mlp.gate" in hq["quantization"]["exclude_modules"]
    cfg = json.loads((tmp_path / "nvfp4" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["quantization_config"]["quant_algo"] == "NVFP4"
    assert (tmp_path / "nvfp4" / "tokenizer.json").exists()
    assert not (tmp_path / "nvfp4.partial").exists()


def test_exclude_calibration_and_shared_amax(tmp_path):
    sd = hf_moe_state()
    src = write_hf(tmp_path / "hf", sd)
    amax = {f"model.layers.0.mlp.experts.{e}.{p}": 3.0 + e for e in range(E) for p in ("gate_proj", "up_proj")}
    amax.update({f"model.layers.0.mlp.experts.{e}.down_proj": 12.0 * (e + 1) for e in range(E)})
    opts = ConvertOptions(exclude=("model.layers.1.*",), input_amax=amax, progress=False)
    checkpoint.convert_hf(str(src), str(tmp_path / "out"), opts)
    out = read_all(tmp_path / "out")
    assert out["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.experts.0.gate_proj.input_scale" not in out  # excluded: not quantized
    assert out["model.layers.0.mlp.experts.0.down_proj.input_scale"].item() == pytest.approx(12.0 / 2688, rel=1e-6)
    assert out["model.layers.0.mlp.experts.1.down_proj.input_scale"].item() == pytest.approx(24.0 / 2688, rel=1e-6)
    assert out["model.layers.0.mlp.experts.2.up_proj.input_scale"].item() == pytest.approx(5.0 / 2688, rel=1e-6)
    assert checkpoint.verify_conversion(str(src), str(tmp_path / "out"), opts) == len(sd)
    with pytest.raises(ConvertError, match="input_scale"):  # verify checks the input scales too
        checkpoint.verify_conversion(str(src), str(tmp_path / "out"), ConvertOptions(exclude=opts.exclude))


def test_bad_inputs_are_refused_and_nothing_is_written(tmp_path):
    sd = hf_moe_state()
    sd["model.layers.0.mlp.experts.2.up_proj.weight"][3, 4] = float("nan")
    src = write_hf(tmp_path / "hf", sd)
    with pytest.raises(ConvertError, match="experts.2.up_proj.weight: contains NaN"):
        checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False))
    assert not (tmp_path / "out").exists()

    sd = hf_moe_state()
    sd["model.layers.0.mlp.experts.0.down_proj.weight"] = torch.randn(H, 40).bfloat16()
    src = write_hf(tmp_path / "hf2", sd)
    with pytest.raises(ConvertError, match="multiple of 16"):
        checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False))

    dense = {"model.layers.0.mlp.down_proj.weight": torch.randn(H, F)}
    src = write_hf(tmp_path / "dense", dense, shards=1)
    with pytest.raises(ConvertError, match="no MoE expert weights recognised"):
        checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False))

    src = write_hf(tmp_path / "half", hf_moe_state())
    os.remove(src / "model-00002-of-00002.safetensors")
    with pytest.raises(ConvertError, match="missing \\(half-written checkpoint\\?\\)"):
        checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False))

    src = write_hf(tmp_path / "ok", hf_moe_state())
    os.makedirs(tmp_path / "exists")
    with pytest.raises(ConvertError, match="exists"):
        checkpoint.convert_hf(str(src), str(tmp_path / "exists"), ConvertOptions(progress=False))


def test_resume_after_interruption(tmp_path, monkeypatch):
    src = write_hf(tmp_path / "hf", hf_moe_state())
    dst = str(tmp_path / "out")
    real_save = convert_output.save_file
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while writing the second shard
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(convert_output, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.convert_hf(str(src), dst, ConvertOptions(progress=False))
    assert not os.path.exists(dst) and os.path.exists(dst + ".partial")
    monkeypatch.setattr(convert_output, "save_file", lambda *a, **k: (calls.append(a[1]), real_save(*a, **k)))
    checkpoint.convert_hf(str(src), dst, ConvertOptions(progress=False, verify=True))
    assert calls[2:] == [calls[1]]  # only the unfinished shard was written again
    assert checkpoint.verify_conversion(str(src), dst) == len(hf_moe_state())


def test_cli_convert_and_verify(tmp_path, capsys):
    src = write_hf(tmp_path / "hf", hf_moe_state())
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--verify", "--quiet"]) == 0
    assert "converted 24 expert linears" in capsys.readouterr().out
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--verify-only"]) == 0
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--quiet"]) == 3  # exists: refused input
    assert "exists" in capsys.readouterr().err


def megatron_named_params(sd, ep_size=1, ep_rank=0, grouped=False):
    """Megatron expert param names of one EP rank built from the HF state (fc1 = gate|up)."""
    local = E // ep_size
    for layer in range(L):
        for i in range(local):
            e = ep_rank * local + i
            p = f"model.layers.{layer}.mlp.experts.{e}"
            fc1 = torch.cat([sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"]])
            fc2 = sd[f"{p}.down_proj.weight"]
            if grouped:
                yield f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight{i}", fc1
                yield f"decoder.layers.{layer}.mlp.experts.linear_fc2.weight{i}", fc2
            else:
                yield f"decoder.layers.{layer}.mlp.experts.local_experts.{i}.linear_fc1.weight", fc1
                yield f"decoder.layers.{layer}.mlp.experts.local_experts.{i}.linear_fc2.weight", fc2
        yield f"decoder.layers.{layer}.mlp.router.weight", sd[f"model.layers.{layer}.mlp.gate.weight"]


@pytest.mark.parametrize("grouped", [False, True])
def test_live_sync_from_ep_ranks_equals_offline_converter(tmp_path, grouped):
    sd = hf_moe_state()
    checkpoint.convert_hf(str(write_hf(tmp_path / "hf", sd)), str(tmp_path / "out"), ConvertOptions(progress=False))
    offline = {k: v for k, v in read_all(tmp_path / "out").items() if ".experts." in k}
    # the converter writes a static input_scale for stock loaders (uncalibrated here); live sync sends
    # weights only and must not replace an engine's (possibly calibrated) input scales
    scales = {k: offline.pop(k) for k in [k for k in offline if k.endswith(".input_scale")]}
    assert len(scales) == L * E * 3 and all(v.item() == checkpoint.UNCALIBRATED_INPUT_SCALE for v in scales.values())
    for ep_size in (1, 2):
        live = {}
        for rank in range(ep_size):
            params = megatron_named_params(sd, ep_size, rank, grouped)
            for bucket in checkpoint.bucketed(checkpoint.megatron_expert_tensors(params, rank, E // ep_size), 4096):
                units = {n.rsplit(".", 2)[0] if ("gate_proj." in n or "up_proj." in n) else n for n, _ in bucket}
                assert sum(t.numel() * t.element_size() for _, t in bucket) <= 4096 or len(units) == 1
                for n, _ in bucket:  # an expert's gate and up (shared global scale) travel together
                    if n.endswith("gate_proj.weight_scale_2"):
                        assert n.replace("gate_proj", "up_proj") in dict(bucket)
                storages = {t.untyped_storage().data_ptr() for _, t in bucket}
                assert len(storages) == len(bucket)  # no aliasing between yielded tensors
                live.update(bucket)
        assert live.keys() == offline.keys()
        for k in live:
            assert (
                torch.equal(live[k].view(torch.uint8), offline[k].view(torch.uint8))
                if live[k].dtype != torch.float32
                else torch.equal(live[k], offline[k])
            ), k


def _etp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    sd = hf_moe_state()
    full = dict(megatron_named_params(sd))
    f = F // world
    local = []
    for name, t in full.items():  # Megatron's expert-TP shards: fc1 = [gate_r; up_r], fc2 = columns r
        if name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2)
            t = torch.cat([gate[rank * f : (rank + 1) * f], up[rank * f : (rank + 1) * f]])
        elif name.endswith("linear_fc2.weight"):
            t = t[:, rank * f : (rank + 1) * f]
        local.append((name, t.contiguous()))
    gathered = dict(checkpoint.gather_expert_tp(local))
    torch.save({"gathered": gathered, "full": full}, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_expert_tp_shards_gather_to_the_full_experts(tmp_path):
    import torch.multiprocessing as mp

    from helpers import free_port

    mp.spawn(_etp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["gathered"].keys() == got["full"].keys()
        for name, t in got["full"].items():
            assert torch.equal(got["gathered"][name], t), name
        live = dict(checkpoint.megatron_expert_tensors(got["gathered"].items(), 0, E))
        want = dict(checkpoint.megatron_expert_tensors(got["full"].items(), 0, E))
        assert live.keys() == want.keys()
        for k in want:
            assert torch.equal(live[k].view(-1).view(torch.uint8), want[k].view(-1).view(torch.uint8)), k
    t = torch.ones(2)
    assert list(checkpoint.gather_expert_tp([("decoder.layers.0.x", t)])) == [("decoder.layers.0.x", t)]  # no group


# ----------------------------------------------------------------------------- data safety


def tree(path) -> dict[str, bytes]:
    """Every file under path (relative name -> bytes): a directory's full content, to compare."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def test_overwrite_never_removes_a_source_or_what_it_did_not_write(tmp_path, monkeypatch):
    src = write_hf(tmp_path / "hf", hf_moe_state())
    before = tree(src)
    opts = ConvertOptions(progress=False, overwrite=True)
    for dst, why in (
        (src, "it is the source"),
        (tmp_path, "it contains the source"),
        (tmp_path / "link", "it is the source"),
    ):
        if dst.name == "link":
            os.symlink(src, dst)  # symlinks count: resolved before comparing
        with pytest.raises(ConvertError, match=why):
            checkpoint.convert_hf(str(src), str(dst), opts)
        assert tree(src) == before
    for inside in (src / "out", tmp_path / "link" / "deeper" / "out"):  # nor writes into a source
        with pytest.raises(ConvertError, match="refusing to write inside the source"):
            checkpoint.convert_hf(str(src), str(inside), ConvertOptions(progress=False))
        assert tree(src) == before
    # an earlier output of the converter is replaced; it is then also what "." or home is here
    out = tmp_path / "out"
    checkpoint.convert_hf(str(src), str(out), ConvertOptions(progress=False))
    checkpoint.convert_hf(str(src), str(out), opts)
    published = tree(out)
    monkeypatch.chdir(out)
    with pytest.raises(ConvertError, match="it is the working directory"):
        checkpoint.convert_hf(str(src), ".", opts)
    monkeypatch.chdir(tmp_path / "hf")
    with pytest.raises(ConvertError, match="it contains the working directory"):
        checkpoint.convert_hf(str(src), str(tmp_path), opts)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(out))
    with pytest.raises(ConvertError, match="it is your home directory"):
        checkpoint.convert_hf(str(src), str(out), opts)
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    assert tree(out) == published
    # a calibration file's directory is a source too
    (out / "amax.json").write_text("{}")
    with pytest.raises(ConvertError, match="it contains the source .*amax.json"):
        checkpoint.convert_hf(
            str(src), str(out), ConvertOptions(progress=False, overwrite=True, source_paths=(str(out / "amax.json"),))
        )
    # an output holding a file the converter did not write is not removed
    with pytest.raises(ConvertError, match=r"holds files quads convert did not write \(\['amax.json'\]\)"):
        checkpoint.convert_hf(str(src), str(out), opts)
    assert (out / "amax.json").read_text() == "{}"
    # a directory without the converter's marker is not removed
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ConvertError, match="mine: refusing to remove it: it was not written by quads convert"):
        checkpoint.convert_hf(str(src), str(mine), opts)
    assert (mine / "notes.txt").read_text() == "keep me"
    assert tree(src) == before


def test_protected_paths_include_root():
    from quads_megatron.checkpoint.ownership import protected_reason

    assert protected_reason("/", []) == "it is the root directory"
    assert protected_reason("/tmp/../", []) == "it is the root directory"


def test_a_partial_dir_the_converter_did_not_write_is_never_removed(tmp_path):
    src = write_hf(tmp_path / "hf", hf_moe_state())
    stranger = tmp_path / "out.partial"
    stranger.mkdir()
    (stranger / "data.bin").write_bytes(b"precious")
    with pytest.raises(ConvertError, match="out.partial: refusing to remove it: it was not written by quads convert"):
        checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False))
    assert (stranger / "data.bin").read_bytes() == b"precious"
    # a source that happens to be named <dst>.partial is not removed either
    src2 = write_hf(tmp_path / "model.partial", hf_moe_state())
    before = tree(src2)
    with pytest.raises(ConvertError, match="model.partial: refusing to remove it: it is the source"):
        checkpoint.convert_hf(str(src2), str(tmp_path / "model"), ConvertOptions(progress=False))
    assert tree(src2) == before


def test_shard_names_must_stay_inside_the_checkpoint(tmp_path):
    sd = hf_moe_state()
    src = write_hf(tmp_path / "hf", sd, shards=1)
    os.rename(src / "model-00001-of-00001.safetensors", tmp_path / "outside.safetensors")
    (src / checkpoint.INDEX).write_text(json.dumps({"weight_map": {n: "../outside.safetensors" for n in sd}}))
    with pytest.raises(ConvertError, match="expected a plain <name>.safetensors file name"):
        checkpoint.convert_hf(str(src), str(tmp_path / "out" / "o"), ConvertOptions(progress=False))
    assert not (tmp_path / "out").exists()


def interrupted_run(src, dst, monkeypatch, tamper=None) -> None:
    """A conversion killed while writing its second shard (tamper(tensors) alters what is saved)."""
    real_save, calls = convert_output.save_file, []

    def save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_save(tamper(tensors) if tamper else tensors, path, metadata=metadata)

    monkeypatch.setattr(convert_output, "save_file", save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.convert_hf(str(src), dst, ConvertOptions(progress=False))
    monkeypatch.setattr(convert_output, "save_file", real_save)


def test_resume_rechecks_finished_shards_and_counts_every_shard_in_the_index(tmp_path, monkeypatch, capsys):
    sd = hf_moe_state()
    src = write_hf(tmp_path / "hf", sd)
    dst = str(tmp_path / "out")
    interrupted_run(src, dst, monkeypatch)
    first = os.path.join(dst + ".partial", "model-00001-of-00002.safetensors")
    with open(first, "r+b") as f:  # the finished shard lost its tail (a crash before the data reached the disk)
        f.truncate(os.path.getsize(first) // 2)
    checkpoint.convert_hf(str(src), dst, ConvertOptions())
    assert checkpoint.verify_conversion(str(src), dst) == len(sd)  # the truncated shard was written again
    out = read_all(dst)
    index = json.loads((tmp_path / "out" / checkpoint.INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    assert "does not match its recorded size and sha256: writing it again" in capsys.readouterr().err

    dst2 = str(tmp_path / "out2")  # an intact finished shard is kept and counted
    interrupted_run(src, dst2, monkeypatch)
    checkpoint.convert_hf(str(src), dst2, ConvertOptions())
    index = json.loads((tmp_path / "out2" / checkpoint.INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in read_all(dst2).values())
    assert "resuming: 1 of 2 shards already done" in capsys.readouterr().err


def test_a_failed_verify_is_never_published_by_the_next_run(tmp_path, monkeypatch):
    sd = hf_moe_state()
    src = write_hf(tmp_path / "hf", sd)
    dst = str(tmp_path / "out")
    real_save = convert_output.save_file

    def corrupting_save(tensors, path, metadata=None):  # a bad write the shard record cannot see
        tensors = dict(tensors)
        tensors["lm_head.weight"] = tensors["lm_head.weight"].clone().fill_(0) if "lm_head.weight" in tensors else None
        real_save({k: v for k, v in tensors.items() if v is not None}, path, metadata=metadata)

    monkeypatch.setattr(convert_output, "save_file", corrupting_save)
    with pytest.raises(ConvertError, match="lm_head.weight differs from the source") as failed:
        checkpoint.convert_hf(str(src), dst, ConvertOptions(progress=False, verify=True))
    assert not os.path.exists(dst)
    monkeypatch.setattr(convert_output, "save_file", real_save)
    checkpoint.convert_hf(str(src), dst, ConvertOptions(progress=False))  # no --verify: redone and verified anyway
    assert checkpoint.verify_conversion(str(src), dst) == len(sd)
    assert "is kept, marked unverified: the next run writes it again and verifies it" in str(failed.value)


def test_verify_compares_bytes_so_copied_nan_passes(tmp_path):
    sd = hf_moe_state()
    sd["model.embed_tokens.weight"][1, 2] = float("nan")  # not quantized: copied as is
    src = write_hf(tmp_path / "hf", sd)
    checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False, verify=True))
    assert torch.isnan(read_all(tmp_path / "out")["model.embed_tokens.weight"][1, 2])
    assert convert_output.same_tensor(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not convert_output.same_tensor(torch.zeros(2, dtype=torch.int16), torch.zeros(1, dtype=torch.int32))
    assert not convert_output.same_tensor(torch.zeros(2, 3), torch.zeros(3, 2))


def test_a_second_conversion_into_the_same_output_is_refused(tmp_path, capsys):
    import socket
    import subprocess
    import sys

    from quads_megatron.checkpoint.ownership import OutputLock

    src = write_hf(tmp_path / "hf", hf_moe_state())
    dst = tmp_path / "out"
    held = OutputLock(str(dst))
    held.acquire()
    try:
        with pytest.raises(
            ConvertError, match=f"out is being written by pid {os.getpid()} on host {socket.gethostname()}"
        ):
            checkpoint.convert_hf(str(src), str(dst), ConvertOptions(progress=False))
    finally:
        held.release()
    assert not dst.exists() and not (tmp_path / "out.partial").exists()
    # a lock left by a process of this host that is gone is taken over, saying so
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"pid": int(gone.stdout), "host": socket.gethostname(), "started": "2026-12-04 10:00:00", "id": "x"}
    (tmp_path / "out.lock").write_text(json.dumps(stale))
    checkpoint.convert_hf(str(src), str(dst), ConvertOptions(progress=False))
    assert f"taking over the stale lock {tmp_path}/out.lock of pid {stale['pid']}" in capsys.readouterr().err
    assert not (tmp_path / "out.lock").exists()
    # one of another host cannot be checked from here: refused, naming the holder
    (tmp_path / "out.lock").write_text(json.dumps({**stale, "host": "other-host"}))
    with pytest.raises(ConvertError, match="pid .* on host other-host"):
        checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False, overwrite=True))


# ----------------------------------------------------------------------------- calibration inputs


def plans_for(layers, w13=(0,), w2=(2,)) -> dict:
    return {f"model.layers.{i}.mlp.experts": {"w13": list(w13), "w2": list(w2)} for i in layers}


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"input_amax": {"model.layers.0.mlp.experts.0.down_proj": float("nan")}}, "experts.0.down_proj is nan"),
        ({"input_amax": {"model.layers.0.mlp.experts.0.down_proj": -1.0}}, "experts.0.down_proj is -1.0"),
        ({"input_amax": {"model.layers.0.mlp.experts.0.down_proj": 0}}, "experts.0.down_proj is 0"),
        ({"input_amax": {"model.layers.0.mlp.experts.0.down_proj": 2.0}}, "covers 1 of 24 quantized modules"),
        ({"quads": {"rac_plans": plans_for([0])}}, r"cover 1 of 2 MoE layers converted; no plan for \['model.layers.1"),
        ({"quads": {"rac_plans": plans_for([0, 1, 2])}}, "name MoE layers that are not converted"),
        (
            {"quads": {"rac_plans": plans_for([0, 1], w13=(2,))}},
            r"layers.0.mlp.experts.w13: block index 2 .* \[0, 2\) for K=32",
        ),
        (
            {"quads": {"rac_plans": plans_for([0, 1], w2=(3,))}},
            r"experts.w2: block index 3 .* \[0, 3\) for K=48 \(MoE inter",
        ),
        ({"quads": {"rac_plans": plans_for([0, 1], w2=(1, 1))}}, "repeated block indices"),
        ({"exclude": ("*.down_proj",), "quads": {"rac_plans": plans_for([0, 1])}}, "w2: that GEMM is not quantized"),
        ({"quads": {"rollout": {"rac": {"selection": "static"}}}}, "selection is static but no RAC plans"),
        ({"quads": {"rollout": {"activation_scale": "static"}}}, "activation_scale is static but no input amax"),
    ],
)
def test_calibration_inputs_are_checked_against_the_converted_layers(tmp_path, opts, message):
    src = write_hf(tmp_path / "hf", hf_moe_state())
    with pytest.raises(ConvertError, match=message):
        checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False, **opts))
    assert os.listdir(tmp_path) == ["hf"]  # refused before anything was written


def test_complete_calibration_inputs_are_accepted(tmp_path):
    src = write_hf(tmp_path / "hf", hf_moe_state())
    rollout = {"activation_scale": "static", "rac": {"selection": "static", "ratio": 0.25}}
    amax = {
        f"model.layers.{i}.mlp.experts.{e}.{p}": 4.0
        for i in range(L)
        for e in range(E)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    quads = {"rollout": rollout, "rac_plans": plans_for([0, 1], w13=(1,), w2=(0, 2))}
    checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False, input_amax=amax, quads=quads))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["quads"]["rac_plans"]["model.layers.1.mlp.experts"] == {"w13": [1], "w2": [0, 2]}
    assert cfg["quads"]["rollout"]["rac"]["selection"] == "static"
    rac_off = {"rollout": {"rac": {"selection": "static", "enabled": False}}}  # no plans needed without RAC
    checkpoint.convert_hf(str(src), str(tmp_path / "out2"), ConvertOptions(progress=False, quads=rac_off))


# ----------------------------------------------------------------------------- ModelOpt layout


def test_output_is_what_modelopt_exports_and_sglang_reads(tmp_path):
    """Every quantized linear has ModelOpt's four tensors (dtypes, shapes); configs carry ModelOpt's
    fields; SGLang 0.5.23's own ModelOpt NVFP4 config reader parses them and keeps the rest BF16."""
    modelopt_quant = pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant")
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    sd = hf_moe_state()
    g = torch.Generator().manual_seed(3)
    for layer in range(L):
        for p in ("k_proj", "v_proj", "o_proj"):
            sd[f"model.layers.{layer}.self_attn.{p}.weight"] = torch.randn(H, H, generator=g).bfloat16()
        sd[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(H).bfloat16()
    src = write_hf(tmp_path / "hf", sd)
    checkpoint.convert_hf(str(src), str(tmp_path / "out"), ConvertOptions(progress=False))
    out = read_all(tmp_path / "out")
    quantized = {n[: -len(".weight")] for n in sd if ".experts." in n}
    for mod in quantized:
        n, k = sd[f"{mod}.weight"].shape
        assert out[f"{mod}.weight"].dtype == torch.uint8 and out[f"{mod}.weight"].shape == (n, k // 2)
        assert out[f"{mod}.weight_scale"].dtype == torch.float8_e4m3fn and out[f"{mod}.weight_scale"].shape == (
            n,
            k // 16,
        )
        for scalar in ("weight_scale_2", "input_scale"):
            assert out[f"{mod}.{scalar}"].dtype == torch.float32 and out[f"{mod}.{scalar}"].shape == (), scalar
        assert out[f"{mod}.input_scale"].item() == checkpoint.UNCALIBRATED_INPUT_SCALE
    assert set(out) == {n for n in sd if ".experts." not in n} | {
        f"{m}.{t}" for m in quantized for t in ("weight", "weight_scale", "weight_scale_2", "input_scale")
    }
    hq = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "quads_megatron"
    assert hq["quantization"] == {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": hq["quantization"]["exclude_modules"],
    }
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    scheme = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert qc["config_groups"] == {"group_0": {"input_activations": scheme, "weights": scheme, "targets": ["Linear"]}}
    assert qc["quant_algo"] == "NVFP4" and qc["quant_method"] == "modelopt" and qc["producer"] == hq["producer"]
    assert qc["ignore"] == hq["quantization"]["exclude_modules"]
    assert "kv_cache_scheme" not in qc  # as ModelOpt: written only when the KV cache is quantized
    for cfg in (qc, hq):
        parsed = modelopt_quant.ModelOptFp4Config.from_config(cfg)
        assert parsed.is_checkpoint_nvfp4_serialized and parsed.group_size == 16
        assert parsed.exclude_modules == qc["ignore"]
        for layer in range(L):
            p = f"model.layers.{layer}"
            assert not parsed.is_layer_excluded(f"{p}.mlp.experts")
            for kept in (f"{p}.self_attn.o_proj", f"{p}.mlp.gate"):
                assert parsed.is_layer_excluded(kept), kept
            assert is_layer_skipped(
                f"{p}.self_attn.qkv_proj", parsed.exclude_modules, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
            )
        assert parsed.is_layer_excluded("lm_head")
