"""CPU tests of what the GPU engine test and the engine/MoE-block benchmarks are made of: the torch
reference model (tests/gpu/engine_ref.py), the engine worker's response parsing, the benchmark's random
checkpoint, conversion, serving folders and result tables (benchmarks/bench_engine.py, bench_moe_block.py).
No engine runs here (tests/gpu/test_sglang_engine.py runs them on the GPU).
"""

import copy
import importlib.util
import json
import os

import bench_engine as be  # benchmarks/ is on the path (pyproject: tool.pytest.ini_options.pythonpath)
import bench_engine_model as bem
import bench_moe_block as bmb
import engine_ref as er
import engine_worker as ew
import pytest
import torch
from tiny_moe import qwen3_moe_config, write_checkpoint

CFG = qwen3_moe_config(
    hidden=128, moe_inter=64, experts=8, topk=2, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=256
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny HF checkpoint, its model with bf16 reference experts, and its three converted modes."""
    root = tmp_path_factory.mktemp("engine_parts")
    bf16 = write_checkpoint(root / "bf16", CFG, seed=0)
    model = er.load_model(bf16, "cpu")
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, CFG["vocab_size"], (4, 12), generator=g)
    paths = {"bf16": bf16}
    for mode in ("dynamic", "off"):
        paths[mode] = str(root / mode)
        er.convert(bf16, paths[mode], mode)
    calib = er.calibrate(model, seqs, str(root / "calib"))
    paths["static"] = str(root / "static")
    er.convert(bf16, paths["static"], "static", calib)
    return {"root": root, "model": model, "paths": paths, "calib": calib, "seqs": seqs}


def test_patched_moe_block_matches_transformers(tmp_path):
    """The reference's routing + bf16 experts reproduce transformers' own Qwen3-MoE block."""
    model = er.load_model(write_checkpoint(tmp_path / "m", CFG, seed=1), "cpu")
    block = model.model.layers[0].mlp
    x = torch.randn(1, 10, CFG["hidden_size"], generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        want = block(x).float()
        er.patch_moe(model, er.Bf16Experts(model))
        got = block(x).float()
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 1e-2  # transformers rounds routing weights to bf16


def test_modes_carry_their_rac_and_scales(tiny):
    """Each converted mode's quads block gives the reference what the serving method reads."""
    paths, calib = tiny["paths"], tiny["calib"]
    assert er.quads_block(paths["dynamic"]) == {}
    h, i = CFG["hidden_size"], CFG["moe_intermediate_size"]
    rac, static = er.layer_rac(er.quads_block(paths["dynamic"]), 0, h, i)
    assert (rac.fc1.dynamic_channels, rac.fc2.dynamic_channels, static) == (h // 2, i // 2, False)
    rac, static = er.layer_rac(er.quads_block(paths["off"]), 0, h, i)
    assert (rac.fc1.plan, rac.fc1.dynamic_channels, rac.fc2.dynamic_channels, static) == (None, 0, 0, False)
    from safetensors.torch import load_file

    plans = load_file(calib["rac_plans"])
    quads = er.quads_block(paths["static"])
    for layer in range(CFG["num_hidden_layers"]):
        rac, static = er.layer_rac(quads, layer, h, i)
        assert static
        assert torch.equal(rac.fc1.plan.blocks, plans[f"{er.moe_prefix(layer)}.w13"])
        assert torch.equal(rac.fc2.plan.blocks, plans[f"{er.moe_prefix(layer)}.w2"])
    with open(calib["input_amax"]) as f:
        amax = json.load(f)
    a13, a2 = er.static_amax(er.read_tensors(paths["static"]), 1, CFG["num_experts"], "cpu")
    want = amax[f"{er.moe_prefix(1)}.0.gate_proj"], amax[f"{er.moe_prefix(1)}.0.down_proj"]
    assert float(a13) == pytest.approx(want[0], rel=1e-6) and float(a2) == pytest.approx(want[1], rel=1e-6)


def test_w4a4_reference_modes_differ_and_stay_finite(tiny):
    model, seqs, paths = tiny["model"], tiny["seqs"], tiny["paths"]
    er.patch_moe(model, er.Bf16Experts(model))
    lps = {"bf16": er.token_logprobs(model, seqs)}
    for mode in er.MODES:
        er.patch_moe(model, er.W4A4Experts(paths[mode], CFG["num_hidden_layers"], CFG["num_experts"], "cpu"))
        lps[mode] = er.token_logprobs(model, seqs)
    er.patch_moe(model, er.Bf16Experts(model))
    for mode, lp in lps.items():
        assert lp.shape == (4, 11) and torch.isfinite(lp).all() and (lp <= 0).all(), mode
    for a in lps:
        for b in lps:
            if a < b:
                assert er.gap(lps[a], lps[b])["mean"] > 0, (a, b)


def test_quantized_modes_amplify_a_non_expert_perturbation(tiny):
    """Why the engine test measures a floor per mode: eager instead of SDPA attention (same math, other
    roundings) moves NVFP4 logprobs several times more than bf16 ones (2026-12-05: ~10x here)."""
    seqs, paths = tiny["seqs"], tiny["paths"]
    floors = {}
    for mode in ("bf16", "dynamic", "off"):
        lps = []
        for attention in ("sdpa", "eager"):
            model = er.load_model(paths["bf16"], "cpu", attention=attention)
            experts = (
                er.Bf16Experts(model)
                if mode == "bf16"
                else er.W4A4Experts(paths[mode], CFG["num_hidden_layers"], CFG["num_experts"], "cpu")
            )
            er.patch_moe(model, experts)
            lps.append(er.token_logprobs(model, seqs))
        floors[mode] = er.gap(*lps)["mean"]
    assert floors["bf16"] > 0, floors
    assert floors["dynamic"] > 3 * floors["bf16"] and floors["off"] > 3 * floors["bf16"], floors


def test_greedy_tokens_are_the_argmax_of_a_full_forward(tiny):
    """In fp32 (bf16 sums differ with the sequence length, enough to flip a near-tie or a routing choice)."""
    model = copy.deepcopy(tiny["model"]).float()
    er.patch_moe(model, er.Bf16Experts(model))
    prompts = tiny["seqs"][:, :5]
    cont = er.greedy(model, prompts, 4)
    seq = torch.cat([prompts, cont], 1)
    with torch.no_grad():
        logits = model(input_ids=seq, use_cache=False).logits.float()
    assert torch.equal(logits[:, 4:-1].argmax(-1), cont)
    lp = er.token_logprobs(model, seq)
    assert lp.shape == (4, 8) and torch.allclose(lp[:, 4:], torch.log_softmax(logits[:, 4:-1], -1).amax(-1))


def test_gap_and_agreement():
    assert er.gap([[0.0, -1.0]], [[0.5, -1.0]]) == {"mean": 0.25, "max": 0.5}
    a = er.agreement([[1, 2, 3, 4], [1, 2, 3, 4]], [[1, 2, 9, 4], [1, 2, 3, 4]])
    assert a == {"identical": 7 / 8, "prefix": (2 / 4 + 4 / 4) / 2}


def test_worker_parses_responses():
    seq = [5, 6, 7, 8]
    meta = {"input_token_logprobs": [(None, 5, None), (-1.0, 6, None), (-2.0, 7, None), (-0.5, 8, None)]}
    assert ew.input_logprobs(meta, seq) == [-1.0, -2.0, -0.5]
    assert ew.input_logprobs({"input_token_logprobs": meta["input_token_logprobs"][1:]}, seq) == [-1.0, -2.0, -0.5]
    # one extra entry at the end (the first generated token): the run of the sequence's ids is found
    extra = {"input_token_logprobs": [*meta["input_token_logprobs"], (-3.0, 1, None)]}
    assert ew.input_logprobs(extra, seq) == [-1.0, -2.0, -0.5]
    with pytest.raises(ValueError, match="do not contain the sequence.* position 1: \\[7, 8\\] vs \\[9, 8\\]"):
        ew.input_logprobs(meta, [5, 6, 9, 8])
    # SGLang reports the last vocabulary id as 0 (its logprob is the real token's)
    relabelled = {"input_token_logprobs": [(None, 5, None), (-1.0, 0, None), (-2.0, 2, None), (-0.5, 3, None)]}
    assert ew.input_logprobs(relabelled, [5, 6, 2, 3], vocab_size=7) == [-1.0, -2.0, -0.5]
    with pytest.raises(ValueError, match="do not contain"):
        ew.input_logprobs(relabelled, [5, 6, 2, 3])
    with pytest.raises(ValueError, match="input logprobs for a sequence"):
        ew.input_logprobs({"input_token_logprobs": [(-1.0, 8, None)]}, seq)
    assert ew.output_logprobs({"output_token_logprobs": [[-0.25, 3, None]]}) == [-0.25]
    state = {
        "disable_cuda_graph": False,
        "cuda_graph_config": {"decode": {"backend": "full", "max_bs": 8}},
        "startup_time": {"cuda_graph": {"decode": 1.5, "prefill": 0.0}},
        "memory_usage": {"graph": {"decode": 0.01}},
    }
    ev = ew.graph_evidence({"internal_states": [state]})
    assert ev["disable_cuda_graph"] is False and ev["decode_backend"] == "full"
    assert ev["capture_s"] == state["startup_time"]["cuda_graph"] and ev["graph_gb"] == {"decode": 0.01}
    assert ew.decode_graph_captured(ev)
    off = dict(state, startup_time={"cuda_graph": {"decode": 0.0}}, memory_usage={"graph": {"decode": 0.0}})
    assert not ew.decode_graph_captured(ew.graph_evidence({"internal_states": [off]}))
    assert not ew.decode_graph_captured(ew.graph_evidence({"internal_states": [dict(state, disable_cuda_graph=True)]}))


# ----------------------------------------------------------------------------- benchmarks


def test_bench_checkpoint_matches_transformers_layout(tmp_path):
    """The benchmark's direct safetensors writer gives the names and shapes transformers saves, and
    transformers loads it without missing or unexpected weights."""
    from safetensors import safe_open
    from transformers import Qwen3MoeForCausalLM

    shape = {"hidden": 128, "moe_inter": 64, "experts": 8, "topk": 2, "heads": 4, "kv_heads": 2, "head_dim": 32}
    cfg = bem.model_config(2, 256, shape)
    info = bem.write_random_checkpoint(str(tmp_path / "direct"), cfg, "cpu")
    hf = write_checkpoint(tmp_path / "hf", {**cfg, "intermediate_size": 4 * 128}, seed=0)

    def layout(path):
        out = {}
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), "pt") as f:
                    out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        return out

    assert layout(str(tmp_path / "direct")) == layout(hf)
    assert info["shards"] == 3 and info["bytes"] == 2 * sum(torch.Size(s).numel() for s in layout(hf).values())
    _, loading = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "direct"), output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]


def test_bench_prepare_writes_arm_folders(tmp_path):
    """Dry run: model, conversion, one serving folder per arm (the SGLang method reads its mode from it),
    a layer subset; folders the benchmark did not write are refused, not deleted."""
    work, out = tmp_path / "w", tmp_path / "o"
    argv = ["--dry-run", "--layers", "2", "--check-layers", "1", "--vocab", "256", "--workdir", str(work)]
    assert be.main([*argv, "--arms", "fp8,bf16", "--out", str(tmp_path / "peers")]) == 0  # no quads arm
    root = work / "tiny-L2-V256"
    assert (root / "bf16").is_dir() and not (root / "nvfp4").exists() and not (root / "quads_dyn").exists()
    assert be.main([*argv, "--out", str(out)]) == 0  # the same checkpoint, now converted
    for arm in bem.QUADS_ARMS:
        with open(root / arm / "hf_quant_config.json") as f:
            quads = json.load(f)["quads"]
        with open(root / arm / "config.json") as f:
            assert json.load(f)["quantization_config"]["quads"]["rollout"] == quads["rollout"]
        assert quads["rollout"] == bem.rollout_config(arm) and len(quads["rac_plans"]) == 2
        assert all(os.path.islink(root / arm / n) for n in os.listdir(root / arm) if n.endswith(".safetensors"))
    sub = root / "quads_dyn_1layers"
    assert sorted(n for n in os.listdir(sub) if n.endswith(".safetensors")) == [
        "model-embed-head.safetensors",
        "model-layer-000.safetensors",
    ]
    with open(sub / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 1
    with open(sub / "model.safetensors.index.json") as f:
        assert not any(".layers.1." in k for k in json.load(f)["weight_map"])
    with open(out / "bench_engine.json") as f:
        res = json.load(f)
    assert res["prepare"]["convert"]["seconds"] > 0 and res["settings"]["layers"] == 2
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(RuntimeError, match="did not write"):
        bem.remove_own(str(foreign))
    with pytest.raises(RuntimeError, match="not made by this benchmark"):
        bem.serving_dir(str(root / "nvfp4"), str(foreign))
    assert (foreign / "notes.txt").read_text() == "keep"
    if importlib.util.find_spec("sglang") is None:
        return
    from quads_megatron.integrations.sglang.method import QuadsNvfp4Config

    got = {}  # what the serving method reads from each arm's folder
    for arm in bem.QUADS_ARMS:
        with open(root / arm / "hf_quant_config.json") as f:
            cfg = QuadsNvfp4Config.from_config(json.load(f))
        rac = cfg.layer_rac("model.layers.1.mlp.experts", 256, 128)
        got[arm] = (rac.fc1.dynamic_channels, rac.fc1.plan is not None, cfg.rollout.activation_scale)
        assert cfg.rollout.weight_layout == ("row_major" if arm == "quads_dyn_rows" else "auto")
    assert got == {"quads_off": (0, False, "dynamic"), "quads_dyn": (128, False, "dynamic"),
                   "quads_dyn_rows": (128, False, "dynamic"),
                   "quads_static": (0, True, "static")}  # fmt: skip


def frag(batches: dict[str, float], steps: dict[str, float] | None = None) -> dict:
    """An arm result as run_arm writes it, from output tok/s (and decode step ms) per batch."""
    row = {}
    for b, tok in batches.items():
        step = (steps or {}).get(b, 1.0)
        row[b] = {k: {"median": v, "min": v, "max": v} for k, v in (("output_tok_s", tok), ("decode_tok_s", tok),
                                                                     ("step_ms", step))}  # fmt: skip
    return {"ok": True, "startup_s": 30.0, "batches": row}


def test_bench_results_merge_ratios_check_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(be, "RESULTS", str(tmp_path / "committed"))  # not the repository's own results
    argv = ["--layers", "12", "--check-layers", "4", "--out", str(tmp_path), "--workdir", str(tmp_path / "w")]
    args = be.parse_args([*argv, "--resume", str(tmp_path / "none.json")])
    with pytest.raises(SystemExit, match="no such file"):
        be.load_results(args)
    args = be.parse_args([*argv, "--resume"])
    res = be.load_results(args)  # nothing to resume from: afresh
    assert res == {"settings": be.settings_of(args), "arms": {}}
    be.merge_arm(res, "fp8", frag({"16": 100.0}))
    be.merge_arm(res, "fp8", frag({"64": 400.0}))  # a later run adds a batch, keeps the first
    be.merge_arm(res, "bf16", frag({"16": 50.0, "64": 200.0}))
    be.merge_arm(res, "quads_dyn", frag({"16": 120.0, "64": 300.0}, {"64": 10.0}))
    be.merge_arm(res, "layercheck", frag({"64": 1.0}, {"64": 4.0}))
    assert set(res["arms"]["fp8"]["batches"]) == {"16", "64"}
    rat = be.ratios(res)
    assert rat["quads_dyn/fp8"] == {"16": 1.2, "64": 0.75} and rat["quads_dyn/bf16"] == {"16": 2.4, "64": 1.5}
    moe = {"rows": [{"tokens": 64, "ours_rac50_us": 250.0}]}
    chk = be.check_gpu_bound(res, moe)["64"]
    assert chk["per_layer_ms"] == pytest.approx(0.75) and chk["fixed_ms"] == pytest.approx(1.0)
    assert chk["layer_share"] == pytest.approx(0.9) and chk["gpu_bound"] and chk["moe_kernels_ms"] == 3.0
    res["ratios"], res["gpu_bound_check"] = rat, be.check_gpu_bound(res, moe)
    res.update(date="2026-12-04", device={"name": "cpu"}, versions={"torch": "x"})
    md = be.markdown(res)
    assert "| 16 | 50 (50-50) | 100 (100-100) | 120 (120-120) |" in md and "| 64 | 1.50 | 0.75 |" in md
    assert "layers 90% of a step (GPU-bound)" in md
    be.finish(res, str(tmp_path / "bench_engine.json"), args)
    assert be.load_results(args)["arms"] == res["arms"]  # resumed from OUT's file
    os.remove(tmp_path / "bench_engine.json")
    assert be.load_results(args)["arms"] == res["arms"]  # from the workdir's copy
    with pytest.raises(SystemExit, match="settings"):
        be.load_results(be.parse_args([*argv, "--layers", "16", "--resume"]))
    res["device"] = {"name": "NVIDIA H200", "sm": "90", "memory_gib": 139.8, "driver": "x"}  # another device
    be.finish(res, str(tmp_path / "bench_engine.json"), args)
    with pytest.raises(SystemExit, match="measured on NVIDIA H200, this is cpu"):
        be.load_results(args)


def test_bench_tiled_layout_ab_ratio_and_probe_token_check():
    """quads_dyn over quads_dyn_rows (the tiled layout's A/B) is a ratio of its own, and the report says whether
    quads_dyn_rows decoded the probe to quads_dyn's tokens (the same numbers on either weight layout)."""
    res = {"settings": {"tiny": True, "layers": 2, "vocab": 256, "input_len": 8, "new_tokens": 4, "repeats": 1}}
    res.update(date="2026-12-07", device={"name": "cpu"}, versions={}, arms={})
    be.merge_arm(res, "quads_dyn", {**frag({"16": 110.0}), "probe_ids": [[1, 2], [3, 4]]})
    be.merge_arm(res, "quads_dyn_rows", {**frag({"16": 100.0}), "probe_ids": [[1, 2], [3, 4]]})
    assert be.ratios(res)["quads_dyn/quads_dyn_rows"] == {"16": pytest.approx(1.1)}
    assert be.token_checks(res) == {"quads_dyn_rows": True}
    assert "- quads_dyn_rows: probe (4 greedy prompts) vs quads_dyn: the same tokens" in be.markdown(res)
    res["arms"]["quads_dyn_rows"]["probe_ids"] = [[1, 2], [3, 5]]
    assert be.token_checks(res) == {"quads_dyn_rows": False} and "FAILED: other tokens" in be.markdown(res)
    del res["arms"]["quads_dyn"]["probe_ids"]  # a result from before the probe: nothing to compare
    assert be.token_checks(res) == {}


def test_bench_engine_fp8_tuned_serves_the_tuned_configs(tmp_path, capsys, monkeypatch):
    """fp8_tuned: the peer files are checked when the arguments are parsed; their configs are laid out as an
    SGLANG_MOE_CONFIG_DIR at the path SGLang looks up; a folder it did not write is refused, not removed."""
    peer = {"file": "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8.json",
            "configs": {"16": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 16,
                               "num_warps": 4, "num_stages": 3}}}  # fmt: skip
    good, bad = tmp_path / "peer.json", tmp_path / "bad.json"
    good.write_text(json.dumps(peer))
    bad.write_text(json.dumps({"file": "../x.json", "configs": {}}))
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    for argv in (["--arms", "fp8_tuned"], ["--arms", "fp8_tuned", "--peer-configs", str(bad)],
                 ["--arms", "fp8_tuned", "--peer-configs", str(listed)],
                 ["--arms", "fp8_tuned", "--peer-configs", str(tmp_path / "missing.json")]):  # fmt: skip
        with pytest.raises(SystemExit):
            be.parse_args(argv)
        assert "peer-configs" in capsys.readouterr().err
    args = be.parse_args(["--arms", "fp8,fp8_tuned", "--peer-configs", str(good)])
    root = tmp_path / "moe"
    for _ in range(2):  # the second call replaces what the first wrote
        assert be.moe_config_dir(str(root), args.peers, "3.6.0") == str(root)
        with open(root / "configs" / "triton_3_6_0" / peer["file"]) as f:
            assert json.load(f) == peer["configs"]
    (root / "configs" / "notes.txt").write_text("keep")
    with pytest.raises(RuntimeError, match="did not write"):
        be.moe_config_dir(str(root), args.peers, "3.6.0")
    assert (root / "configs" / "notes.txt").read_text() == "keep"
    res = {"settings": {}, "arms": {}}
    be.merge_arm(res, "fp8", frag({"16": 100.0}))
    be.merge_arm(res, "fp8_tuned", frag({"16": 125.0}))
    be.merge_arm(res, "quads_off", frag({"16": 150.0}))
    assert be.ratios(res) == {"quads_off/fp8": {"16": 1.5}, "quads_off/fp8_tuned": {"16": 1.2}}
    log = ("[x] Using default MoE kernel config. Performance might be sub-optimal! Config file not found at "
           "/c/triton_3_6_0/E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8.json\n"
           "Config file not found at /c/triton_3_6_0/E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json\n")  # fmt: skip
    down = ("Using default MoE kernel config. Performance might be sub-optimal! Config file not found at "
            "/c/triton_3_6_0/E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8_down.json")  # fmt: skip
    assert len(be.config_misses(log)) == 1 and be.config_misses("arm fp8_tuned batch 16: 7000 tok/s") == []
    # a `_down` line is not counted: with the up file missing SGLang logs that miss on its own line; with
    # it found, SGLang reuses it for the down projection
    assert be.config_misses(down) == []
    reuse = ("[2026-12-06 04:34:29] Down MoE config file not found at /w/sglang_moe_configs/configs/triton_3_6_0/"
             "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8_down.json; reusing the tuned "
             "up-projection config without TMA. Performance might be sub-optimal.")  # fmt: skip
    assert be.config_used(reuse, "/w/sglang_moe_configs") and not be.config_used(reuse, "/elsewhere")
    assert be.config_used("Using MoE kernel config from /w/sglang_moe_configs/configs/x.json.", "/w/sglang_moe_configs")
    assert not be.config_used(log + down, "/c")  # misses only: no sign that a tuned file was read
    res["arms"]["fp8_tuned"]["config_misses"] = be.config_misses(log)
    res.update(date="2026-12-06", device={"name": "cpu"}, versions={}, ratios=be.ratios(res))
    res["settings"] = {"layers": 12, "vocab": 1, "input_len": 1, "new_tokens": 2, "repeats": 1, "tiny": False}
    assert "- fp8_tuned: WARNING, SGLang found no tuned config here" in be.markdown(res)
    # the peer file above is tuned up to 16 tokens: batch 4 x 4 input tokens is covered, batch 64 x 64 not
    assert be.peer_coverage(args.peers, [1, 4], 4) == []
    short = be.peer_coverage(args.peers, [16, 64], 64)
    assert len(short) == 1 and "tuned up to 16 tokens" in short[0] and "4096 tokens" in short[0]
    res["arms"]["fp8_tuned"]["config_coverage"] = short
    assert f"- fp8_tuned: WARNING, {short[0]}" in be.markdown(res)
    # two files under one SGLang name would overwrite each other: refused; a resume with other configs too
    twin = tmp_path / "twin.json"
    twin.write_text(json.dumps({**peer, "configs": {"64": peer["configs"]["16"]}}))
    with pytest.raises(SystemExit):
        be.parse_args(["--arms", "fp8_tuned", "--peer-configs", f"{good},{twin}"])
    assert "both" in capsys.readouterr().err
    out = ["--out", str(tmp_path / "o"), "--workdir", str(tmp_path / "w")]
    args = be.parse_args(["--arms", "fp8_tuned", "--peer-configs", str(good), *out])
    monkeypatch.setattr(be, "RESULTS", str(tmp_path / "committed"))  # not the repository's own results
    res = be.load_results(args)
    res.update(date="2026-12-06", device={"name": "cpu"}, versions={})
    be.merge_arm(res, "fp8_tuned", {**frag({"16": 125.0}), "peer_configs": be.peer_configs_of(args.peers)})
    be.finish(res, str(tmp_path / "o" / "bench_engine.json"), args)
    again = be.parse_args(["--arms", "fp8_tuned", "--peer-configs", str(good), "--resume", *out])
    assert be.load_results(again)["arms"]["fp8_tuned"]["batches"]["16"]
    other = be.parse_args(["--arms", "fp8_tuned", "--peer-configs", str(twin), "--resume", *out])
    with pytest.raises(SystemExit, match="other tuned configs"):
        be.load_results(other)


@pytest.mark.parametrize(
    "argv",
    [["--arms", "bf16,nope"], ["--batches", "16,x"], ["--batches", "0"], ["--layers", "4", "--check-layers", "4"]],
)
def test_bench_engine_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        be.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_moe_block_floors_and_fp8_quantization():
    s = bmb.SHAPE
    nv, f8, bf = (bmb.expert_bytes(f, s["hidden"], s["inter"]) for f in ("nvfp4", "fp8", "bf16"))
    elems = 3 * s["hidden"] * s["inter"]
    assert nv == elems // 2 + elems // 16 + 8 and bf == 2 * elems and f8 == elems + 4 * (12 * 16 + 16 * 6)
    # 128 experts hit at 16 tokens: 128 * nv bytes + 2 * 16 * 2048 * 2 bytes at 4.8 TB/s
    assert bmb.floor_us("nvfp4", 128, 16, s, 4.8) == pytest.approx((128 * nv + 131072) / 4.8e6)
    w = torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(0))
    for quant in (bmb.fp8_block_quant, bmb.fp8_tensor_quant):
        q, scale = quant(w)
        deq = q.float() * (
            scale.repeat_interleave(128, 1).repeat_interleave(128, 2) if scale.dim() == 3 else scale[:, None, None]
        )
        assert float((deq - w).norm() / w.norm()) < 0.05
    with pytest.raises(ValueError, match="unknown weight format"):
        bmb.expert_bytes("int4", 16, 16)


def test_moe_block_dry_run_row(tmp_path):
    shape = {"experts": 4, "hidden": 128, "inter": 128, "topk": 2}
    arms = "ours,torch_bf16,ours_other_layout,ours_whole_row,ours_torch_route,ours_other_routing"
    args = bmb.parse_args(["--dry-run", "--tokens", "4", "--arms", arms, "--workdir", str(tmp_path)])
    assert args.layout == "tiled"  # what the SGLang method serves at these shapes
    inp = bmb.make_inputs(shape, "cpu", tiled=True)
    assert inp["nvfp4"].tiled
    row = bmb.measure(4, shape, inp, None, args, print)
    assert row["check_ok"] and row["ours_max_abs_err"] == 0.0  # on a CPU, auto is the reference
    assert row["other_layout_same_bits"] and not inp["nvfp4_other"].tiled and row["whole_row_same_bits"]
    assert 0 < row["rel_err_vs_bf16"]["ours"] < 0.5 and row["rel_err_vs_bf16"]["torch_bf16"] == 0.0
    assert row["ours_us"] > 0 and row["ours_vs_torch_bf16"] > 0 and row["errors"] == {}
    assert (row["routing"], row["other_routing"]) == ("fused", "kernel") and row["ours_other_routing_us"] > 0
    result = {"date": "2026-12-04", "device": {"name": "cpu"}, "versions": {}, "shape": shape, "hbm_tbps": 4.8,
              "rows": [row]}  # fmt: skip
    md = bmb.markdown(result)
    assert "| 4 |" in md and "PASS (rel err" in md and "other layout: the same bits" in md
    assert "row as one tile: the same bits" in md and "ours, row as one tile" in md
    assert "| fused (other: kernel) |" in md
    row = bmb.measure(4, shape, inp, None, bmb.parse_args(["--dry-run", "--arms", "sglang_fp8"]), print)
    assert row["errors"] == {"sglang_fp8": "SGLang's fused MoE needs CUDA and sglang"}
    assert "sglang_fp8 not measured" in bmb.markdown({**result, "rows": [row]})
    with pytest.raises(SystemExit):
        bmb.parse_args(["--arms", "ours,bogus"])


def test_moe_block_tuned_fp8_peer_candidates_and_config_file():
    """A tuned FP8 arm tries SGLang's own config first, then each point of its grid once; its winners are
    written under the file name SGLang looks up for this GPU, shape and weight format, keyed by tokens."""
    shipped = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32, "num_warps": 4,
               "num_stages": 3}  # fmt: skip
    block_grid = bmb.PEER_GRIDS["sglang_fp8"]
    cands = bmb.peer_candidates(shipped, block_grid)
    grid = 1
    for values in block_grid.values():
        grid *= len(values)
    assert cands[0] == shipped and len(cands) == grid + 1
    assert all(c not in cands[:i] for i, c in enumerate(cands))
    in_grid = dict(cands[1])
    assert bmb.peer_candidates(in_grid, block_grid)[0] == in_grid
    assert len(bmb.peer_candidates(in_grid, block_grid)) == grid
    assert all(c["BLOCK_SIZE_K"] == bmb.FP8_BLOCK for c in cands)  # one block scale per K step
    assert {c["BLOCK_SIZE_K"] for c in bmb.peer_candidates(None, bmb.PEER_GRIDS["sglang_fp8_tensor"])} == {128, 256}
    assert set(bmb.TUNED_ARMS) == set(bmb.TUNED_FILES) and set(bmb.TUNED_ARMS) <= set(bmb.ARMS)
    rows = [{"tokens": 16, "sglang_fp8_tuned_config": cands[3], "sglang_fp8_tensor_tuned_config": cands[4]},
            {"tokens": 64}]  # fmt: skip
    result = {"shape": bmb.SHAPE, "device": {"name": "NVIDIA H100 80GB HBM3"}, "rows": rows}
    assert bmb.tuned_config_file(result, "sglang_fp8_tuned") == {
        "file": "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8,block_shape=[128, 128].json",
        "configs": {"16": cands[3]},
    }
    assert bmb.tuned_config_file(result, "sglang_fp8_tensor_tuned") == {
        "file": "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8.json",
        "configs": {"16": cands[4]},
    }
    row = {"tokens": 16, "hbm_floor_us": 50.0, "fp8_floor_us": 100.0, "ours_us": 100.0, "sglang_fp8_us": 200.0,
           "sglang_fp8_tuned_us": 150.0, "sglang_fp8_tuned_config": cands[3], "sglang_fp8_tuned_timed": grid + 1,
           "check_ok": True}  # fmt: skip
    row.update(bmb.ratios(row))
    assert row["ours_vs_sglang_fp8_tuned"] == 1.5 and row["sglang_fp8_tuned_pct_floor"] == pytest.approx(200 / 3)
    md = bmb.markdown(
        {"date": "2026-12-06", "device": {"name": "cpu"}, "versions": {}, "shape": bmb.SHAPE, "hbm_tbps": 3.35,
         "rows": [row], "sglang_tuned_configs": {"sglang_fp8": False, "sglang_bf16": True}}
    )  # fmt: skip
    assert "fp8 no (its default), bf16 yes" in md and "| 1.50 |" in md
    assert f"- 16 tokens ({grid + 1} timed): BLOCK_SIZE_M" in md
    shape = {"experts": 4, "hidden": 128, "inter": 128, "topk": 2}
    args = bmb.parse_args(["--dry-run", "--arms", "sglang_fp8_tuned,sglang_fp8_tensor_tuned"])
    row = bmb.measure(4, shape, bmb.make_inputs(shape, "cpu"), None, args, print)
    assert row["errors"] == {a: "SGLang's fused MoE needs CUDA and sglang" for a in bmb.TUNED_ARMS}
