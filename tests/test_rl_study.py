"""`quads rl` on the CPU with real megatron-core: the dry run end to end through the CLI, resuming in pieces
gives the uninterrupted run's numbers, one-line refusals, the engine's CPU stand-in and its sync stream,
the per-layer attribution, and the live-sync stream loading into SGLang's own Qwen3-MoE (BF16 and
quads_nvfp4) exactly as the exported checkpoint does."""

import itertools
import json
import math
import os

import pytest
import torch

import quads_megatron
from quads_megatron import checkpoint, cli, nvfp4
from quads_megatron.rl import report
from quads_megatron.rl.command import EXIT_UNFINISHED
from quads_megatron.rl.runs import RunDir, read_json
from quads_megatron.rl.spec import MODEL_PRESETS, ArmSpec, StudySpec

SMALL = ["--dry-run", "--steps", "3", "--sft-steps", "6", "--sft-target", "1.0"]


def done_rows(out: str, stage: str) -> list[dict]:
    d = RunDir(out).done(stage)
    assert d is not None, f"{stage} did not finish"
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in d["rows"]]


def test_dry_run_end_to_end(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert cli.main(["rl", "--out", out, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "reproduced: naive NVFP4 rollout drifts above the BF16 floor" in printed or "did NOT reproduce" in printed
    summary = os.path.join(out, "summary")
    assert {"rl_summary.md", "rl_summary.json", "rl_curves.png", "rl_attribution.png"} <= set(os.listdir(summary))
    data = read_json(os.path.join(summary, "rl_summary.json"))
    assert list(data["arms"]) == ["bf16", "naive", "quads"] and all(a["done"] for a in data["arms"].values())
    for a in data["arms"].values():
        assert len(a["rows"]) == 4
        for r in a["rows"]:
            for k in ("rollout/raw_reward", report.GAP, report.GAP_MAX, "rollout_corr/k3_kl", "train/grad_norm"):
                assert math.isfinite(r[k]), k
    s = {n: a["summary"] for n, a in data["arms"].items()}
    assert s["naive"]["gap_mean"] > s["bf16"]["gap_mean"]  # NVFP4 W4A4 drifts above the stand-in's BF16 floor
    assert s["quads"]["gap_mean"] < s["naive"]["gap_mean"]
    for name in ("naive", "quads"):
        at = data["arms"][name]["attribution"]
        assert [r["layer"] for r in at["layers"]] == [1, 2] and at["emulated_gap"] > 0
    assert data["arms"]["bf16"]["attribution"] is None
    md = open(os.path.join(summary, "rl_summary.md")).read()
    assert "## What did NOT reproduce" in md and "## Per-layer attribution: naive" in md
    assert not quads_megatron.is_applied()


def test_resuming_in_pieces_repeats_the_uninterrupted_run(tmp_path, capsys):
    whole = str(tmp_path / "whole")
    assert cli.main(["rl", "--out", whole, *SMALL]) == 0
    pieces = str(tmp_path / "pieces")
    codes = []
    for _ in range(20):
        codes.append(cli.main(["rl", "--out", pieces, *SMALL, "--piece-steps", "4"]))
        if codes[-1] != EXIT_UNFINISHED:
            break
    assert codes[-1] == 0 and len(codes) >= 4, codes  # 6 SFT + 3 x 3 RL steps in pieces of 4
    assert "run the same command again" in capsys.readouterr().out
    for stage in ("sft", "bf16", "naive", "quads"):
        assert done_rows(pieces, stage) == done_rows(whole, stage), stage
    for arm in ("naive", "quads"):
        assert RunDir(pieces).done(arm)["attribution"] == RunDir(whole).done(arm)["attribution"]
    assert not any(f.endswith(".pt") for f in os.listdir(os.path.join(pieces, "arms", "quads")))


def test_an_arms_own_learning_rate_trains_it(tmp_path):
    """bf16@LR starts from the same SFT weights and sees the same first batch as bf16; only the update
    differs (its step size), and the summary names the lr."""
    out = str(tmp_path / "run")
    assert cli.main(["rl", "--out", out, *SMALL, "--arms", "bf16,bf16@3e-3", "--lr", "1e-3", "--steps", "2"]) == 0
    plain, own = done_rows(out, "bf16"), done_rows(out, "bf16@3e-3")
    assert plain[0]["rollout/raw_reward"] == own[0]["rollout/raw_reward"]  # same weights, prompts and samples
    assert plain[1] != own[1]  # the second step sees weights updated at different rates
    md = open(os.path.join(out, "summary", "rl_summary.md")).read()
    assert "lr 0.001" in md and "BF16 trainer, BF16 rollout, GRPO lr 0.003" in md


def one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and lines[-1].startswith(prefix), err
    return lines[-1]


def test_refusals_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        cli.main(["rl", "--out", out, "--dry-run", "--group", "1"])
    assert e.value.code == 2
    assert "--group must be >= 2" in one_line(capsys, "quads rl: error:")
    assert cli.main(["rl", "--out", out, "--dry-run", "--budget-s", "0"]) == EXIT_UNFINISHED
    assert cli.EXIT_UNFINISHED == EXIT_UNFINISHED
    assert cli.main(["rl", "--out", out, "--dry-run", "--steps", "5"]) == cli.EXIT_INPUT
    assert "another study (steps: 5 here, 4 in the run directory)" in one_line(capsys, "quads rl: error:")
    if not torch.cuda.is_available():
        assert cli.main(["rl", "--out", str(tmp_path / "gpu")]) == cli.EXIT_INPUT
        line = one_line(capsys, "quads rl: error:")
        assert "missing: a CUDA GPU" in line and "--dry-run" in line
        assert not os.path.exists(tmp_path / "gpu")  # refused before anything was written


# ----------------------------------------------------------------------------- the stand-in and the attribution


@pytest.fixture(scope="module")
def tiny():
    from quads_megatron.rl.trainer import Trainer, setup_megatron

    setup_megatron(0)
    spec = StudySpec(model=MODEL_PRESETS["tiny"], engine="emulate", digits=2).validate()
    trainer = Trainer(spec.model, "cpu", 0, 1e-3)
    with torch.no_grad():  # weights with structure (and BF16-representable, as a GPU trainer's are)
        for p in trainer.model.parameters():
            p.copy_((p * 3).bfloat16().float())
    return spec, trainer


def test_stand_in_receives_the_sync_stream(tiny):
    from quads_megatron.rl.emulate import EmulatedRollout

    spec, trainer = tiny
    bf16 = EmulatedRollout(ArmSpec.parse("bf16"), spec)
    bf16.sync(trainer.model)
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), bf16.model.named_parameters(), strict=True):
        assert torch.equal(q, p.bfloat16().float()), n
    quads = EmulatedRollout(ArmSpec.parse("quads"), spec)
    quads.sync(trainer.model)
    named = [(n, p.detach()) for n, p in trainer.model.named_parameters()]
    want = dict(checkpoint.megatron_expert_tensors(named, 0, spec.model.experts))
    down = nvfp4.from_modelopt(
        *(want[f"model.layers.1.mlp.experts.3.down_proj.{k}"] for k in ("weight", "weight_scale", "weight_scale_2"))
    )
    assert quads.weights[(1, 3, "fc2")].same_bits(down)
    fc1 = quads.weights[(0, 2, "fc1")]
    gate = want["model.layers.0.mlp.experts.2.gate_proj.weight"]
    assert torch.equal(fc1.codes[: gate.shape[0]], gate) and fc1.codes.shape[0] == 2 * gate.shape[0]
    prompts = torch.zeros(4, 6, dtype=torch.long)
    a1, l1 = quads.generate(prompts, 3)
    quads.set_rng_state(bf16.rng_state())
    a2, l2 = quads.generate(prompts, 3)
    assert a1.shape == (4, 3) and torch.equal(a1, a2) and torch.equal(l1, l2)  # the sampler resumes
    assert (l1 <= 0).all()


def test_attribution_per_layer(tiny):
    from quads_megatron.rl.attribution import attribute
    from quads_megatron.rl.emulate import EmulatedRollout

    spec, trainer = tiny
    arm = ArmSpec.parse("naive")
    ro = EmulatedRollout(arm, spec)
    ro.sync(trainer.model)
    prompts = torch.randint(0, 10, (8, 6), generator=torch.Generator().manual_seed(0))
    answers, logp = ro.generate(prompts, 3)
    res = attribute(trainer.model, torch.cat([prompts, answers], 1), 6, logp, arm, 4)
    assert not quads_megatron.is_applied()  # the naive arm's weight QDQ was applied for the attribution only
    assert [r["layer"] for r in res["layers"]] == [1, 2]
    assert res["emulated_gap"] > 0 and res["engine_gap"] > 0
    for r in res["layers"]:
        assert r["gap_only"] > 0 and 0 < r["fc1_rel_err"] < 0.1 and 0 < r["fc2_rel_err"] < 0.1
    rac = attribute(trainer.model, torch.cat([prompts, answers], 1), 6, logp, ArmSpec.parse("rac100"), 4)
    assert all(a["fc1_rel_err"] < b["fc1_rel_err"] / 4 for a, b in zip(rac["layers"], res["layers"], strict=True))


# ----------------------------------------------------------------------------- sync into SGLang's model (CPU)


@pytest.fixture(scope="module")
def sglang_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU SGLang model; the GPU test syncs into a real engine")
    pytest.importorskip("sglang")
    import sglang_env

    with sglang_env.cpu_runtime():
        yield sglang_env


@pytest.mark.parametrize("arm", ["bf16", "quads"])
def test_sync_stream_loads_into_sglang_like_the_exported_checkpoint(tiny, tmp_path, sglang_cpu, arm):
    from quads_megatron.integrations import sglang as plug
    from quads_megatron.rl.rollout import engine_checkpoint, sync_stream
    from quads_megatron.rl.trainer import export_hf

    spec, trainer = tiny
    a = ArmSpec.parse(arm)
    quant = None if a.rollout == "bf16" else "quads_nvfp4"
    served = engine_checkpoint(a, export_hf(trainer.model, spec.model, str(tmp_path / "hf0")), str(tmp_path / "e0"))
    if quant:
        quads = json.load(open(os.path.join(served, "hf_quant_config.json")))["quads"]
        assert quads["rollout"]["rac"] == {"enabled": True, "ratio": 0.5, "selection": "dynamic", "metric": "residual"}
    model = sglang_cpu.build_model(served, quantization=quant)[1]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = [p.detach().clone() for p in trainer.model.parameters()]
    with torch.no_grad():  # the trainer takes a step (its weights stay BF16-representable, as on a GPU)
        for p in trainer.model.parameters():
            p.copy_((p * 1.25).bfloat16().float())
    want_dir = engine_checkpoint(a, export_hf(trainer.model, spec.model, str(tmp_path / "hf1")), str(tmp_path / "e1"))
    want = dict(sglang_cpu.build_model(want_dir, quantization=quant)[1].named_parameters())
    stream = sync_stream(trainer.model, spec.model, packed=quant is not None)
    for bucket in checkpoint.bucketed(stream, 1 << 14):
        plug.load_weights(model, bucket)
    written = 0
    for n, p in model.named_parameters():
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.uint8 else p, want[n]), n
        written += not torch.equal(p, before[n])
    assert written >= len(before) - 2 * spec.model.layers * bool(quant)  # (input scales stay)
    with torch.no_grad():
        for p, w in zip(trainer.model.parameters(), saved, strict=True):
            p.copy_(w)


def test_sync_stream_names(tiny):
    from quads_megatron.rl.rollout import sync_stream

    spec, trainer = tiny
    names = [n for n, _ in sync_stream(trainer.model, spec.model, packed=True)]
    assert len(names) == len(set(names))
    experts = [n for n in names if ".mlp.experts." in n]
    assert len(experts) == spec.model.layers * spec.model.experts * 3 * 3  # gate/up/down: weight, scales, global
    assert any(n == "lm_head.weight" for n in names) and any(n.endswith("mlp.gate.weight") for n in names)
    bf16 = [n for n, _ in itertools.islice(sync_stream(trainer.model, spec.model, packed=False), 1000)]
    assert sum(".mlp.experts." in n for n in bf16) == spec.model.layers * spec.model.experts * 3


def test_stages_in_worker_processes(tmp_path, capsys):
    """The GPU path's process handling on the CPU: each stage in a worker process, its lines echoed; a stage
    that fails leaves an error.json with its traceback and the study going on."""
    from quads_megatron.rl.runs import Budget
    from quads_megatron.rl.study import run_study

    spec = StudySpec(
        arms=("bf16", "naive"), model=MODEL_PRESETS["tiny"], engine="emulate", digits=2, steps=2, prompts=2,
        group=2, sft_steps=3, sft_batch=8, ckpt_every=1,
    ).validate()  # fmt: skip
    rd = RunDir(str(tmp_path / "run"))
    rd.init(spec)
    lines: list[str] = []
    assert run_study(rd, spec, Budget(None), lines.append, workers=True) == "done"
    echoed = capsys.readouterr().out
    assert "  | " in echoed and "naive: done (2 steps)" in echoed
    assert os.path.exists(rd.path("logs", "naive.log")) and len(RunDir(rd.root).done("naive")["rows"]) == 2
    timing = rd.timing()  # what the next piece plans with: each stage's process start and stop, measured
    measured = ("sft_start_s", "start_s", "engine_stop_s", "stop_s")
    assert {*measured, "first_step_s"} <= set(timing), timing
    assert all(0 < timing[k] < 120 for k in measured), timing
    assert not any(os.path.exists(os.path.join(rd.stage_dir(s), "closing.json")) for s in ("sft", *spec.arms))
    # a broken SFT checkpoint: the arms fail one by one, each with its traceback, and the study says so
    rd2 = RunDir(str(tmp_path / "run2"))
    rd2.init(spec)
    assert run_study(rd2, spec, Budget(None, piece_steps=3), lines.append) == "unfinished"  # the SFT only
    assert rd2.done("sft") is not None and rd2.done("bf16") is None
    with open(rd2.path("sft", "weights.pt"), "wb") as f:
        f.write(b"not a checkpoint")
    assert run_study(rd2, spec, Budget(None), lines.append, workers=True) == "failed"
    for arm in spec.arms:
        err = json.load(open(os.path.join(rd2.stage_dir(arm), "error.json")))
        assert "Traceback" in err["traceback"] and err["error"], err
    assert any(line.startswith("naive: FAILED: ") for line in lines), lines
    assert "  ! " in capsys.readouterr().out  # the traceback's tail is in the piece's own output


def test_a_worker_stopped_before_its_first_step_records_a_start_that_long(tmp_path, monkeypatch):
    """A stage whose process outlives the deadline before any step is stopped, and its start is recorded as
    at least that long, so the next piece does not plan with the same too small estimate again."""
    import time

    from quads_megatron.rl import study
    from quads_megatron.rl.runs import Budget

    spec = StudySpec(
        arms=("bf16",), model=MODEL_PRESETS["tiny"], engine="emulate", digits=2, steps=1, prompts=2, group=2,
        sft_steps=3, sft_batch=8,
    ).validate()  # fmt: skip
    rd = RunDir(str(tmp_path / "run"))
    rd.init(spec)
    monkeypatch.setattr(study, "GRACE_S", 0.0)  # stopped 1 s after launch: imports and Megatron take longer
    monkeypatch.setattr(study, "KILL_AFTER_S", 2.0)
    lines: list[str] = []
    t0 = time.time()
    study.run_in_worker(rd, "sft", Budget(time.time()), lines.append)
    assert any("stopping it" in x for x in lines), lines
    assert study.progress(rd, "sft") == 0
    assert 1.0 <= rd.timing()["sft_start_s"] <= time.time() - t0, rd.timing()


def test_a_worker_killed_by_sglang_points_at_the_schedulers_traceback():
    from quads_megatron.rl.study import worker_failure

    log = "[  1.0s] step 3\n" + "x" * 7000 + "\nERROR Scheduler hit an exception: Traceback ...\nValueError: refused\n"
    rec = worker_failure(-9, log)
    assert "scheduler failed first" in rec["error"] and rec["traceback"].startswith("Scheduler hit an exception")
    assert "ValueError: refused" in rec["traceback"]
    plain = worker_failure(1, "a" * 7000 + "end")
    assert plain["error"] == "worker exited with 1"
    assert plain["traceback"].endswith("end") and len(plain["traceback"]) == 6000


def test_the_gpu_requirement_check_imports_neither_te_nor_sglang():
    """`quads rl` decides whether it can run before any stage starts, in a process that only orchestrates: it
    must not import Transformer Engine or SGLang (seconds of imports, a CUDA context) to do so."""
    import subprocess
    import sys

    code = """
import importlib.util, sys, torch
torch.cuda.is_available = lambda: True  # a GPU machine, as far as the check can tell
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: object() if name == "transformer_engine" else real(name, *a)
from quads_megatron.rl.command import missing_for_gpu
print(repr(missing_for_gpu()), sorted(m for m in sys.modules if m.split(".")[0] in ("sglang", "transformer_engine")))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "None []", res.stdout  # SGLang 0.5.23 is in range; nothing was imported
