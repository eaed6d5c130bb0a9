"""CPU RL demo: the rollout engine's numerics are consistent, and a short run writes its outputs."""

import argparse
import csv
import math
import re

import pytest
import torch

import quads_megatron
from quads_megatron import cli, config
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


def rollout_gap(model, mode, qat, ratio=0.0, selection="dynamic"):
    """Mean |logp_rollout - logp_train| on one fixed batch at a fixed checkpoint (no training)."""
    cfg = config.QuadsConfig.from_dict({"rollout": {"rac": {"ratio": ratio, "selection": selection}}})
    prompts, _ = demo.make_prompts(128, torch.Generator().manual_seed(5))
    if qat:
        quads_megatron.apply(cfg, model=model)
    try:
        eng = demo.RolloutEngine(model, mode, cfg.rollout)
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
    half_static = rollout_gap(sft_model, "quads", qat=True, ratio=0.5, selection="static")
    assert 0 < floor < naive / 3  # NVFP4 rollout drifts well above the bf16 engine floor
    assert full_rac < 2 * floor  # matched weights + fully compensated activations: back at the floor
    assert full_rac < half_rac < naive  # RAC ratio orders the gap
    assert full_rac < half_static < naive


def test_short_run_writes_metrics(tmp_path, capsys):
    ns = type("NS", (), {**vars(demo.DemoArgs(steps=3, sft_steps=5, prompts=4, group=4)), "out": str(tmp_path)})
    assert demo.main(ns) == 0
    rows = list(csv.DictReader(open(tmp_path / "demo_metrics.csv")))
    assert [r["arm"] for r in rows] == ["bf16"] * 3 + ["naive"] * 3 + ["quads"] * 3
    for r in rows:
        assert all(math.isfinite(float(r[k])) for k in ("reward", "mean_abs_gap", "max_abs_gap", "kl_rollout_train"))
    summary = (tmp_path / "demo_summary.md").read_text()
    assert "| quads |" in summary and "mean gap: bf16 floor" in summary
    assert "quads rollout: RAC dynamic, ratio 0.5; activation scale dynamic" in summary
    table = [line for line in summary.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 3 and all(len(markdown_cells(line)) == 5 for line in table)
    assert (tmp_path / "demo_gaps.png").stat().st_size > 1000
    assert not quads_megatron.is_applied()  # the QUADS arm removed its patches


def markdown_cells(row: str) -> list[str]:
    """Cells of a markdown table row: split on '|' not escaped with a backslash."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def test_summary_table_escapes_pipes_in_cells():
    rows = [
        {
            "arm": "quads",
            "first_reward": 0.1,
            "final_reward": 0.5,
            "mean_abs_gap": 0.01,
            "max_abs_gap": 0.2,
            "kl_rollout_train": 0.001,
        }
    ]
    table = demo.summary_table(rows)
    header = markdown_cells(table[0])
    assert header == [
        "arm",
        "reward first -> last",
        "mean \\|logp_rollout - logp_train\\|",
        "max \\|gap\\|",
        "KL(rollout\\|\\|train)",
    ]
    assert all(len(markdown_cells(line)) == len(header) for line in table)
    assert markdown_cells(table[2])[0] == "quads"


def test_plots_have_titles_and_axis_labels():
    rows = [
        {"arm": arm, "step": s, "reward": 0.1 * s, "mean_abs_gap": 0.01, "max_abs_gap": 0.1}
        for arm in demo.ARMS
        for s in range(3)
    ]
    fig = demo.make_figure(rows)
    try:
        assert len(fig.axes) == 3
        for ax in fig.axes:
            assert ax.get_title() and ax.get_xlabel() == "RL step" and ax.get_ylabel()
            assert [line.get_label() for line in ax.get_lines()] == list(demo.ARMS)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


@pytest.mark.parametrize(
    "flags,flag",
    [
        (["--steps", "0"], "--steps"),
        (["--prompts", "-1"], "--prompts"),
        (["--group", "1"], "--group"),
        (["--experts", "2", "--topk", "3"], "--topk"),
        (["--hidden", "40"], "--hidden"),
        (["--hidden", "0"], "--hidden"),
        (["--ffn", "24"], "--ffn"),
        (["--lr", "0"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--clip", "1.5"], "--clip"),
        (["--tis-cap", "-1"], "--tis-cap"),
        (["--layers", "0"], "--layers"),
        (["--sft-steps", "-3"], "--sft-steps"),
        (["--config", "/nonexistent/quads.yaml"], "--config"),
    ],
)
def test_bad_demo_arguments_are_argparse_errors(flags, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--out", str(tmp_path / "out"), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: ") and err[-1].startswith(f"quads demo: error: {flag} ")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_demo_arguments_without_a_parser_raise_value_error():
    ns = argparse.Namespace(**vars(demo.DemoArgs()))
    ns.experts, ns.topk = 2, 4
    with pytest.raises(ValueError, match="^--topk must be <= --experts"):
        demo.parse_args(ns)


def _engine_and_inputs(rollout: dict):
    model = demo.TinyMoEGPT(demo.DemoArgs(layers=1))
    cfg = config.QuadsConfig.from_dict({"rollout": rollout})
    eng = demo.RolloutEngine(model, "quads", cfg.rollout)
    eng.sync_weights()
    eng.calibrate(torch.cat(demo.make_prompts(64, torch.Generator().manual_seed(3)), 1))
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 4, 64)
    return eng, eng.weights[(0, 0)][0], x, cfg.rollout.rac


def reference_linear(x, w, **kw):
    from quads_megatron.rollout import reference

    return reference.w4a4_linear_reference(reference.quantize_activation(x, **kw), w)


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_quads_rollout_follows_dynamic_selection_and_ratio(ratio):
    eng, w, x, rac = _engine_and_inputs({"rac": {"selection": "dynamic", "ratio": ratio}})
    assert eng.plans == {} and eng.amax == {}  # dynamic: nothing calibrated
    got = eng._linear(x, w, 0, "fc1")
    assert torch.equal(got, reference_linear(x, w, dynamic_channels=rac.num_channels(64)))
    assert not torch.equal(got, reference_linear(x, w))  # RAC changed the numbers


def test_quads_rollout_follows_static_selection():
    eng, w, x, rac = _engine_and_inputs({"rac": {"selection": "static", "ratio": 0.25, "metric": "amax"}})
    plan = eng.plans[(0, "fc1")]
    assert plan.num_channels == rac.num_channels(64) == 16
    got = eng._linear(x, w, 0, "fc1")
    assert torch.equal(got, reference_linear(x, w, plan=plan))
    assert not torch.equal(got, reference_linear(x, w, dynamic_channels=16))


def test_quads_rollout_static_activation_scale_and_rac_off():
    eng, w, x, _ = _engine_and_inputs({"activation_scale": "static", "rac": {"enabled": False}})
    assert eng.plans == {} and set(eng.amax) == {(0, "fc1"), (0, "fc2")}
    got = eng._linear(x, w, 0, "fc1")
    assert torch.equal(got, reference_linear(x, w, static_amax=eng.amax[(0, "fc1")]))
    assert not torch.equal(got, reference_linear(x, w))
