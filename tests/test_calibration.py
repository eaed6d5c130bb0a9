"""RAC calibration on real megatron-core MoE layers (SequentialMLP experts, gloo, CPU): what the hooks
record equals the rows the rollout's fc1 / fc2 quantize, computed independently from the router's
decisions; the files they produce are what `quads convert` reads; EP=2 merges to EP=1's statistics."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

import quads_megatron
from helpers import free_port, load_expert_state, random_expert_state
from quads_megatron import checkpoint, nvfp4
from quads_megatron.config import RACConfig
from quads_megatron.demo.cpu_megatron import (
    build_moe_layer,
    init_distributed,
    install_cpu_shims_for_megatron,
    moe_config,
)
from quads_megatron.errors import RACPlanError
from quads_megatron.integrations.megatron import calibration as megatron_calibration
from quads_megatron.integrations.megatron import qat as megatron_core
from quads_megatron.rollout import calibration, moe_block, reference

E, H, F, TOPK = 4, 64, 48, 2


def swiglu_config(**kw):
    return moe_config(num_experts=E, hidden=H, ffn=F, topk=TOPK, activation_func=torch.nn.functional.silu, **kw)


pytestmark = pytest.mark.usefixtures("megatron_world", "clean_quads_patches")


def tokens(seed: int, n: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, H, generator=g)
    x[..., 16:32] *= 30  # one hot block: every plan of fc1's input must take block 1
    return x


def expected(layer, xs, qat: bool) -> dict[str, list[torch.Tensor]]:
    """fc1 rows (each token once per routed expert) and act(gate) * up of fc1's output, per expert,
    from the router's own routing map and the experts' weights (qdq'd under QAT)."""
    out = {"w13": [], "w2": []}
    for x in xs:
        flat = x.reshape(-1, H)
        with torch.no_grad():
            _, routing_map = layer.router(x)
            for e, expert in enumerate(layer.experts.local_experts):
                rows = flat[routing_map[:, e]]
                w1 = expert.linear_fc1.weight.detach()
                y = rows @ (nvfp4.qdq(w1) if qat else w1).t()
                out["w13"].append(rows)
                out["w2"].append(moe_block.gated_activation(y, "silu"))
    return out


@pytest.mark.parametrize("qat", [False, True])
def test_hooks_record_what_the_rollout_gemms_quantize(qat):
    if qat:
        quads_megatron.apply()
    layer = build_moe_layer(swiglu_config(), seed=0, layer_number=3)
    xs = [tokens(1), tokens(2)]
    with megatron_calibration.record_expert_inputs(layer) as cal:
        for x in xs:
            layer(x)
    layer(tokens(3))  # after the with: no hook left, nothing recorded
    want = expected(layer, xs, qat)
    prefix = "model.layers.2.mlp.experts"  # layer_number 3 -> HF index 2
    assert sorted(cal.stats) == [f"{prefix}.w13", f"{prefix}.w2"]
    for gemm in ("w13", "w2"):
        rows = torch.cat(want[gemm])
        assert cal.tokens[f"{prefix}.{gemm}"] == rows.shape[0] == 2 * 24 * TOPK
        assert cal.amax[f"{prefix}.{gemm}"] == pytest.approx(float(rows.abs().max()), rel=1e-6)
        torch.testing.assert_close(
            cal.stats[f"{prefix}.{gemm}"], reference.residual_block_scores(rows).sum(0), rtol=1e-4, atol=1e-6
        )
    plans = cal.plans(RACConfig(ratio=0.25).num_channels)
    assert plans[f"{prefix}.w13"].num_channels == H // 4 and 1 in plans[f"{prefix}.w13"].blocks.tolist()
    assert plans[f"{prefix}.w2"].k == F


def test_calibration_files_are_what_convert_reads(tmp_path):
    layer = build_moe_layer(swiglu_config(), seed=0, layer_number=1)
    with megatron_calibration.record_expert_inputs(layer) as cal:
        layer(tokens(1))
    paths = calibration.save_calibration(str(tmp_path / "calib"), cal.merged(), RACConfig(ratio=0.5).num_channels, E)
    assert sorted(os.listdir(tmp_path / "calib")) == sorted(os.path.basename(p) for p in paths.values())
    extras = checkpoint.quads_extras(None, paths["rac_plans"])  # what `quads convert --rac-plans` embeds
    plans = cal.plans(RACConfig(ratio=0.5).num_channels)
    for gemm in ("w13", "w2"):
        got = extras["rac_plans"]["model.layers.0.mlp.experts"][gemm]
        assert got == plans[f"model.layers.0.mlp.experts.{gemm}"].blocks.tolist()
    with open(paths["input_amax"]) as f:
        amax = json.load(f)
    named = [(f"decoder.layers.0.mlp.{n}", p.detach()) for n, p in layer.named_parameters()]
    tensors = dict(checkpoint.megatron_expert_tensors(named, 0, E, input_amax=amax))
    for e in range(E):
        base = f"model.layers.0.mlp.experts.{e}"
        for proj, gemm in (("gate_proj", "w13"), ("up_proj", "w13"), ("down_proj", "w2")):
            want = nvfp4.input_scale_from_amax(torch.tensor(cal.amax[f"model.layers.0.mlp.experts.{gemm}"]))
            assert torch.equal(tensors[f"{base}.{proj}.input_scale"], want)


def test_bad_calibrations_are_refused_and_write_nothing(tmp_path):
    cal = calibration.RACCalibrator()
    cal.observe("model.layers.0.mlp.experts.w13", torch.randn(4, 32))
    with pytest.raises(RACPlanError, match="both w13 and w2"):
        calibration.save_calibration(str(tmp_path / "a"), cal, lambda k: 16, E)
    cal.observe("fc1_of_something", torch.randn(4, 32))
    with pytest.raises(RACPlanError, match="not named"):
        calibration.save_calibration(str(tmp_path / "b"), cal, lambda k: 16, E)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    x = torch.randn(4, 32)
    x[2, 7] = float("nan")
    with pytest.raises(nvfp4.NVFP4InputError, match="calibration input of L.w13.*NaN"):
        cal.observe("L.w13", x)
    assert "L.w13" not in cal.stats and "L.w13" not in cal.tokens
    with pytest.raises(RACPlanError, match="K/16"):
        cal.observe("model.layers.0.mlp.experts.w13", torch.randn(4, 48))


def test_experts_the_rollout_cannot_serve_are_refused_without_hooks_left():
    layer = build_moe_layer(moe_config(num_experts=E, hidden=H, ffn=F), seed=0)  # Megatron's default: GELU GLU
    with pytest.raises(megatron_core.QuadsPatchError, match="activation_func=gelu"):
        with megatron_calibration.record_expert_inputs(layer):
            pass
    assert all(not e.linear_fc1._forward_hooks for e in layer.experts.local_experts)
    with pytest.raises(megatron_core.QuadsPatchError, match="no Megatron-Core MoELayer"):
        with megatron_calibration.record_expert_inputs(torch.nn.Linear(2, 2)):
            pass
    for field in ("moe_apply_probs_on_input", "use_transformer_engine_op_fuser"):
        layer = build_moe_layer(swiglu_config(), seed=0)
        setattr(layer.config, field, True)  # fc1's input would not be the rollout's / hooks never fire
        with pytest.raises(megatron_core.QuadsPatchError, match=field):
            with megatron_calibration.record_expert_inputs(layer):
                pass


def test_a_layer_whose_experts_bypass_the_hooks_is_reported():
    layers = torch.nn.ModuleList([build_moe_layer(swiglu_config(), seed=0, layer_number=n) for n in (1, 2)])
    with pytest.raises(megatron_core.QuadsPatchError, match=r"model.layers.1.mlp.experts"):
        with megatron_calibration.record_expert_inputs(layers):
            layers[0](tokens(1))  # layer 2 never runs: like fused experts that skip linear_fc1


def _ep_worker(rank: int, world: int, port: int, workdir: str) -> None:
    install_cpu_shims_for_megatron()
    init_distributed(rank, world, port=port, ep=world)
    layer = build_moe_layer(swiglu_config(), seed=0)
    load_expert_state(layer, random_expert_state(E, H, F), rank)
    batches = [tokens(10), tokens(11)]
    with megatron_calibration.record_expert_inputs(layer) as cal:
        for x in batches if world == 1 else batches[rank : rank + 1]:  # EP=1 sees both ranks' batches
            layer(x)
    merged = cal.merged()
    torch.save((merged.stats, merged.amax, merged.tokens), os.path.join(workdir, f"ep{world}_rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_ep2_merges_to_ep1_statistics(tmp_path):
    for world in (1, 2):
        mp.spawn(_ep_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    stats1, amax1, tokens1 = torch.load(tmp_path / "ep1_rank0.pt")
    for rank in (0, 1):
        stats2, amax2, tokens2 = torch.load(tmp_path / f"ep2_rank{rank}.pt")
        assert tokens2 == tokens1 and amax2 == amax1  # every rank holds the merged record
        for name, s in stats1.items():
            torch.testing.assert_close(stats2[name], s, rtol=1e-5, atol=1e-6)


def test_config_metric_picks_the_calibration_statistic(tmp_path, monkeypatch):
    """rollout.rac.metric decides what the calibrator records: 'amax' keeps max |x| per 16-channel block."""
    layer = build_moe_layer(swiglu_config(), seed=0, layer_number=1)
    xs = [tokens(1), tokens(2)]
    with megatron_calibration.record_expert_inputs(layer, config={"rollout": {"rac": {"metric": "amax"}}}) as cal:
        for x in xs:
            layer(x)
    assert cal.metric == "amax"
    want = expected(layer, xs, qat=False)
    for gemm in ("w13", "w2"):
        rows = torch.cat(want[gemm])
        block_amax = rows.abs().reshape(rows.shape[0], -1, 16).amax(dim=(0, 2))
        torch.testing.assert_close(cal.stats[f"model.layers.0.mlp.experts.{gemm}"], block_amax)
    yaml_path = tmp_path / "q.yaml"
    yaml_path.write_text("rollout:\n  rac:\n    metric: amax\n")
    monkeypatch.setenv("QUADS_CONFIG", str(yaml_path))  # no config argument: the trainer's QUADS_CONFIG
    with megatron_calibration.record_expert_inputs(layer) as cal_env:
        layer(xs[0])
    assert cal_env.metric == "amax"
    with pytest.raises(ValueError, match="differs from the config's rollout.rac.metric 'amax'"):
        with megatron_calibration.record_expert_inputs(layer, calibration.RACCalibrator("residual"), config=yaml_path):
            pass


def test_calibration_example_reads_metric_and_ratio_from_the_yaml(tmp_path, capsys):
    import importlib.util

    from safetensors import safe_open

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "calibrate_rac.py")
    spec = importlib.util.spec_from_file_location("calibrate_rac_example", example)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yaml_path = tmp_path / "q.yaml"
    yaml_path.write_text("rollout:\n  rac:\n    metric: amax\n    ratio: 0.25\n")
    paths = mod.main(str(tmp_path / "calib"), str(yaml_path))
    with safe_open(paths["stats"], "pt") as f:
        assert f.metadata()["metric"] == "amax"
    extras = checkpoint.quads_extras(None, paths["rac_plans"])
    blocks = extras["rac_plans"]["model.layers.0.mlp.experts"]
    assert len(blocks["w13"]) == 1 and len(blocks["w2"]) == 1  # 25% of K=64 -> 16 channels, one block
    assert "metric amax, ratio 0.25" in capsys.readouterr().out
