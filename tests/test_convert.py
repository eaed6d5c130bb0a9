"""Converter: HF safetensors -> NVFP4 ModelOpt layout, identical to the trainer's QDQ; live sync."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quads_megatron import checkpoint, fake_quant, nvfp4
from quads_megatron.checkpoint import ConvertError, ConvertOptions
from quads_megatron.checkpoint import hf as hf_convert
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
    opts = ConvertOptions(
        exclude=("model.layers.1.*",),
        input_amax={"model.layers.0.mlp.experts.0.down_proj": 12.0},
        progress=False,
    )
    checkpoint.convert_hf(str(src), str(tmp_path / "out"), opts)
    out = read_all(tmp_path / "out")
    assert out["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.0.mlp.experts.0.down_proj.input_scale"].item() == pytest.approx(12.0 / 2688, rel=1e-6)
    assert "model.layers.0.mlp.experts.1.down_proj.input_scale" not in out


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
    real_save = hf_convert.save_file
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while writing the second shard
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(hf_convert, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.convert_hf(str(src), dst, ConvertOptions(progress=False))
    assert not os.path.exists(dst) and os.path.exists(dst + ".partial")
    monkeypatch.setattr(hf_convert, "save_file", lambda *a, **k: (calls.append(a[1]), real_save(*a, **k)))
    checkpoint.convert_hf(str(src), dst, ConvertOptions(progress=False, verify=True))
    assert calls[2:] == [calls[1]]  # only the unfinished shard was written again
    assert checkpoint.verify_conversion(str(src), dst) == len(hf_moe_state())


def test_cli_convert_and_verify(tmp_path, capsys):
    src = write_hf(tmp_path / "hf", hf_moe_state())
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--verify", "--quiet"]) == 0
    assert "converted 24 expert linears" in capsys.readouterr().out
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--verify-only"]) == 0
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--quiet"]) == 2  # exists
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
