"""CPU RL demo: the rollout engine's numerics are consistent, and a short run writes its outputs."""

import csv
import math

import pytest
import torch

import quads_megatron
from quads_megatron import config
from quads_megatron.demo import rl as demo
from quads_megatron.demo.cpu_megatron import init_distributed, install_cpu_shims_for_megatron


@pytest.fixture(scope="module")
def sft_model():
    install_cpu_shims_for_megatron()
    init_distributed()
    a = demo.DemoArgs(sft_steps=80)
    model = demo.TinyMoEGPT(a)
    demo.sft(model, a, torch.Generator().manual_seed(0), lambda m: None)
    return model


def rollout_gap(model, mode, qat, ratio=0.0):
    """Mean |logp_rollout - logp_train| on one fixed batch at a fixed checkpoint (no training)."""
    cfg = config.QuadsConfig.from_dict({"rollout": {"rac": {"ratio": ratio}}})
    prompts, _ = demo.make_prompts(128, torch.Generator().manual_seed(5))
    if qat:
        quads_megatron.apply(cfg, model=model)
    try:
        eng = demo.RolloutEngine(model, mode, cfg.rollout.rac)
        eng.sync_weights()
        eng.calibrate(torch.cat(demo.make_prompts(128, torch.Generator().manual_seed(3)), 1))
        with torch.no_grad():
            ans, logp_roll = eng.generate(prompts, torch.Generator().manual_seed(7))
            logp_train = demo.train_logprobs(model, prompts, ans)
        return (logp_roll - logp_train).abs().mean().item()
    finally:
        if qat:
            quads_megatron.remove()


def test_engine_numerics_decompose_as_expected(sft_model):
    floor = rollout_gap(sft_model, "bf16", qat=False)
    naive = rollout_gap(sft_model, "naive", qat=False)
    full_rac = rollout_gap(sft_model, "quads", qat=True, ratio=1.0)
    half_rac = rollout_gap(sft_model, "quads", qat=True, ratio=0.5)
    assert 0 < floor < naive / 3  # NVFP4 rollout drifts well above the bf16 engine floor
    assert full_rac < 2 * floor  # matched weights + fully compensated activations: back at the floor
    assert full_rac < half_rac < naive  # RAC ratio orders the gap


def test_short_run_writes_metrics(tmp_path, capsys):
    ns = type("NS", (), {**vars(demo.DemoArgs(steps=3, sft_steps=5, prompts=4, group=4)), "out": str(tmp_path)})
    assert demo.main(ns) == 0
    rows = list(csv.DictReader(open(tmp_path / "demo_metrics.csv")))
    assert [r["arm"] for r in rows] == ["bf16"] * 3 + ["naive"] * 3 + ["quads"] * 3
    for r in rows:
        assert all(math.isfinite(float(r[k])) for k in ("reward", "mean_abs_gap", "max_abs_gap", "kl_rollout_train"))
    summary = (tmp_path / "demo_summary.md").read_text()
    assert "| quads |" in summary and "mean gap: bf16 floor" in summary
    assert (tmp_path / "demo_gaps.png").stat().st_size > 1000
    assert not quads_megatron.is_applied()  # the QUADS arm removed its patches
