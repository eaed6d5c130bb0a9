"""`quads rl` parts without a model: the task's generator and verifier, GRPO math against hand-computed values,
metric names, arm and study specs, the run directory, the time budget, the report's claims, and the parsing
of SGLang engine responses."""

import json
import math
import os
import re

import pytest
import torch

from quads_megatron.rl import grpo, report
from quads_megatron.rl.runs import Budget, RunDir, RunError, read_json, write_json
from quads_megatron.rl.spec import ARM_PRESETS, MODEL_PRESETS, ArmSpec, SpecError, StudySpec, parse_arms
from quads_megatron.rl.task import EQ, PLUS, SORT, Task, add_digits, render

# ----------------------------------------------------------------------------- task


def test_add_answers_are_the_reversed_digits_of_the_sum():
    task = Task("add", 6)
    prompts, answers = task.sample(500, torch.Generator().manual_seed(0))
    assert prompts.shape == (500, task.prompt_len) == (500, 14) and answers.shape == (500, task.answer_len) == (500, 7)
    assert (prompts[:, 6] == PLUS).all() and (prompts[:, -1] == EQ).all()
    for p, a in zip(prompts.tolist(), answers.tolist(), strict=True):
        x, y = int("".join(map(str, p[:6]))), int("".join(map(str, p[7:13])))
        assert int("".join(map(str, reversed(a)))) == x + y
    lengths = {len(str(int("".join(map(str, p[:6]))))) for p in prompts.tolist()}
    assert lengths == {1, 2, 3, 4, 5, 6}  # easy and hard problems mix


def test_add_digits_carries_through():
    a, b = torch.tensor([[9, 9, 9]]), torch.tensor([[0, 0, 1]])
    assert add_digits(a, b).tolist() == [[0, 0, 0, 1]]  # 999 + 1 = 1000, least significant first


def test_sort_and_scoring():
    task = Task("sort", 5)
    prompts, answers = task.sample(50, torch.Generator().manual_seed(1))
    assert (prompts[:, 0] == SORT).all() and (prompts[:, -1] == EQ).all()
    assert torch.equal(answers, prompts[:, 1:6].sort(1).values)
    truth = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    reward, exact = Task("sort", 4).score(torch.tensor([[1, 2, 3, 4], [5, 0, 7, 12]]), truth)
    assert reward.tolist() == [1.0, 0.5] and exact.tolist() == [True, False]
    assert render([1, PLUS, 2, EQ, 3, 99]) == "1+2=3?"
    with pytest.raises(ValueError, match="digits"):
        Task("add", 0)


def test_the_generator_is_reproducible():
    t = Task("add", 8)
    a = t.sample(8, torch.Generator().manual_seed(3))
    b = t.sample(8, torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- GRPO


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2])
    adv = grpo.group_advantages(r, 2)
    s = math.sqrt(0.5)  # unbiased std of (1, 0)
    assert adv.tolist() == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0, 0, 0, 0])


def test_mismatch_metrics_by_hand_and_names():
    lt = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    lr = torch.tensor([[-1.5, -2.0], [-0.5, -0.4]])
    m = grpo.mismatch_metrics(lt, lr)
    assert set(m) == {
        "train/train_rollout_logprob_abs_diff",  # slime
        "train/train_rollout_logprob_abs_diff_max",
        "training/rollout_probs_diff_mean",  # verl
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_std",
        "rollout_corr/kl",  # verl rollout_corr
        "rollout_corr/k3_kl",
    }
    assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx(((0.5 + 0) / 2 + (0 + 0.3) / 2) / 2)
    assert m["train/train_rollout_logprob_abs_diff_max"] == pytest.approx(0.5)
    assert m["rollout_corr/kl"] == pytest.approx((-0.5 + 0 + 0 - 0.3) / 4)
    r = torch.tensor([0.5, 0.0, 0.0, 0.3], dtype=torch.float64)  # logp_train - logp_rollout
    assert m["rollout_corr/k3_kl"] == pytest.approx(float((r.exp() - r - 1).mean()))
    pd = (lr.double().exp() - lt.double().exp()).abs()
    assert m["training/rollout_probs_diff_max"] == pytest.approx(float(pd.max()))
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(float(pd.mean()))


def test_policy_loss_clip_and_tis_by_hand():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.2]])  # ratio exp(0) = 1 and exp(0.2) = 1.2214
    roll = torch.tensor([[-0.5, -2.2]])  # TIS weights exp(old - roll): exp(-0.5) = 0.6065, exp(0) = 1
    adv = torch.tensor([2.0])
    loss, sums = grpo.policy_loss(logp, old, roll, adv, clip=0.1)
    # token 2: ratio 1.2214 > 1 + 0.1 with a positive advantage: the clipped term wins
    assert float(loss.detach()) == pytest.approx((-2.0 * 1.0 + -2.0 * 1.1) / 2)
    assert float(sums["train/pg_clipfrac"]) == 1.0 and "train/tis" not in sums
    assert float(sums["train/ppo_kl"]) == pytest.approx(-0.2)
    loss, sums = grpo.policy_loss(logp, old, roll, adv, clip=0.1, tis_cap=0.9)
    w = [math.exp(-0.5), 0.9]  # the second weight (1.0) is capped
    assert float(loss.detach()) == pytest.approx((-2.0 * w[0] + -2.0 * 1.1 * w[1]) / 2)
    assert float(sums["train/tis_clipfrac"]) == 1.0
    assert float(sums["train/tis"]) == pytest.approx(math.exp(-0.5) + 1.0)
    assert float(sums["train/tis_abs"]) == pytest.approx(1 - math.exp(-0.5))
    loss.backward()
    assert logp.grad[0, 1] == 0  # clipped: no gradient
    assert float(logp.grad[0, 0]) == pytest.approx(-2.0 * w[0] / 2)


def test_micro_batch_losses_add_up_to_the_batch_mean():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 3, generator=g)
    roll = logp + 0.1 * torch.randn(6, 3, generator=g)
    adv = torch.randn(6, generator=g)
    whole, _ = grpo.policy_loss(logp, logp, roll, adv, 0.2, 2.0)
    parts = sum(
        float(grpo.policy_loss(logp[s], logp[s], roll[s], adv[s], 0.2, 2.0, 18)[0]) for s in (slice(0, 4), slice(4, 6))
    )
    assert parts == pytest.approx(float(whole))


# ----------------------------------------------------------------------------- spec


def test_arms_parse_and_presets():
    assert ArmSpec.parse("bf16") == ArmSpec("bf16", "bf16", False, 0.0)
    assert ArmSpec.parse("naive") == ArmSpec("naive", "nvfp4", False, 0.0)
    assert ArmSpec.parse("quads") == ArmSpec("quads", "nvfp4", True, 0.5)
    assert ArmSpec.parse("rac12.5") == ArmSpec("rac12.5", "nvfp4", True, 0.125)
    assert ArmSpec.parse("naive-tis").tis_cap == 2.0
    assert parse_arms("main,rac25,quads") == ("bf16", "naive", "quads", "rac25")
    assert parse_arms("all") == ARM_PRESETS["all"] == (
        "bf16", "naive", "quads", "rac0", "rac12.5", "rac25", "rac100", "naive-tis"
    )  # fmt: skip
    for bad in ("fp8", "rac101", "racx", "quads-tis-tis"):
        with pytest.raises(SpecError, match="^--arms: unknown arm"):
            parse_arms(bad)


def test_an_arm_may_carry_its_own_learning_rate():
    a = ArmSpec.parse("quads-tis@2e-4")
    assert (a.rollout, a.qat, a.rac_ratio, a.tis_cap, a.lr) == ("nvfp4", True, 0.5, 2.0, 2e-4)
    assert a.learning_rate(5e-5) == 2e-4 and ArmSpec.parse("quads").learning_rate(5e-5) == 5e-5
    assert a.label.endswith(", TIS cap 2, GRPO lr 0.0002")
    assert parse_arms("main@1e-4,bf16,bf16@1e-4") == ("bf16@1e-4", "naive@1e-4", "quads@1e-4", "bf16")
    for bad in ("bf16@", "bf16@x", "bf16@0", "bf16@-1e-4", "bf16@inf", "bf16@nan", "bf16@1e-4@2"):
        with pytest.raises(SpecError, match="^--arms: arm .* the learning rate after '@' must be a number > 0"):
            parse_arms(bad)
    with pytest.raises(SpecError, match="^--arms: unknown arm 'fp8@1e-4'"):
        parse_arms("fp8@1e-4")
    # the RAC sweep (and its claim) compares QAT arms at the study's lr only
    assert report.rac_sweep(["rac0", "quads@1e-4", "rac25-tis", "rac100", "naive", "quads"]) == [
        (0.0, "rac0"),
        (0.5, "quads"),
        (1.0, "rac100"),
    ]


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(steps=0), "--steps"),
        (dict(group=1), "--group"),
        (dict(lr=float("nan")), "--lr"),
        (dict(task="mul"), "--task"),
        (dict(digits=40), "--digits"),
        (dict(sft_target=0.0), "--sft-target"),
        (dict(mem_fraction=0.95), "--mem-fraction"),
        (dict(arms=("bf16", "bf16")), "--arms"),
        (dict(model=MODEL_PRESETS["tiny"].__class__(hidden=72)), "--hidden"),
        (dict(model=MODEL_PRESETS["tiny"].__class__(topk=64)), "--topk"),
    ],
)
def test_spec_validation_names_the_flag(kw, flag):
    with pytest.raises(SpecError, match=f"^{flag} "):
        StudySpec(**kw).validate()


def test_spec_round_trips_and_the_h200_model_is_in_range():
    spec = StudySpec().validate()
    assert StudySpec.from_dict(json.loads(spec.fingerprint())) == spec
    assert 100e6 <= spec.model.parameters() <= 300e6
    assert 8 <= spec.model.layers <= 12 and 32 <= spec.model.experts <= 64 and spec.model.topk in (4, 8)


# ----------------------------------------------------------------------------- run directory and budget


def test_run_dir_refuses_another_spec(tmp_path):
    rd = RunDir(str(tmp_path / "run"))
    spec = StudySpec(steps=10).validate()
    assert rd.init(spec) is False and rd.init(spec) is True
    with pytest.raises(RunError, match=r"another study \(steps: 11 here, 10 in the run directory\)"):
        rd.init(StudySpec(steps=11).validate())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    with pytest.raises(RunError, match="not a `quads rl` run directory"):
        RunDir(str(tmp_path / "other")).init(spec)


def test_atomic_json_and_timings(tmp_path):
    p = str(tmp_path / "a.json")
    write_json(p, {"x": 1})
    assert read_json(p) == {"x": 1} and os.listdir(tmp_path) == ["a.json"]
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(RunError, match="unreadable"):
        read_json(str(tmp_path / "bad.json"))
    rd = RunDir(str(tmp_path / "run"))
    rd.init(StudySpec().validate())
    rd.record_time("step_s", 2.0)
    rd.record_time("step_s", 1.0)  # the largest seen is kept
    assert rd.timing() == {"step_s": 2.0}


def test_budget():
    assert Budget(None).allows(1e9)
    b = Budget.seconds(100.0, piece_steps=2)
    assert b.allows(50) and not b.allows(200)
    b.step_done()
    b.step_done()
    assert not b.allows(1)  # the piece's step quota is used up


# ----------------------------------------------------------------------------- report


def rows(reward: list[float], gap: float, gap_max: float) -> list[dict]:
    return [
        {
            "step": i,
            "rollout/raw_reward": r,
            "rollout/exact_match": 0.0,
            report.GAP: gap,
            report.GAP_MAX: gap_max,
            "training/rollout_probs_diff_max": gap / 2,
            "rollout_corr/k3_kl": gap**2 / 2,
            "rollout_corr/kl": 0.0,
            "perf/step_s": 1.0,
        }
        for i, r in enumerate(reward)
    ]


def test_claims_are_decided_by_the_numbers():
    up = [0.3 + 0.01 * i + 0.001 * (i % 3) for i in range(40)]
    flat = [0.3 + 0.001 * (i % 3) for i in range(40)]
    s = {
        "bf16": report.arm_summary(rows(up, 0.01, 0.5)),
        "naive": report.arm_summary(rows(flat, 0.05, 1.3)),
        "quads": report.arm_summary(rows(up, 0.015, 0.8)),
        "rac0": report.arm_summary(rows(up, 0.03, 1.0)),
        "rac100": report.arm_summary(rows(up, 0.012, 0.7)),
    }
    got = {c["claim"].split(" (")[0]: c["reproduced"] for c in report.claims(s, tuple(s))}
    assert got == {
        "naive NVFP4 rollout drifts above the BF16 floor": True,
        "QUADS": True,  # "QUADS (QAT + RAC 50%) keeps ..."
        "QUADS closes at least half of naive's excess gap over the BF16 floor": True,
        "a larger RAC ratio gives a smaller gap": True,
        "the policy improves under RL": True,
        "naive NVFP4 rollout degrades RL": True,
        "QUADS recovers RL": True,
    }
    s["quads"] = report.arm_summary(rows(flat, 0.06, 1.4))  # worse than naive everywhere
    s["rac100"] = report.arm_summary(rows(up, 0.04, 1.4))
    got = {c["claim"].split(" (")[0]: c["reproduced"] for c in report.claims(s, tuple(s))}
    assert got["QUADS"] is False and got["a larger RAC ratio gives a smaller gap"] is False
    assert got["QUADS recovers RL"] is False
    del s["naive"]
    missing = [c for c in report.claims(s, tuple(s)) if c["reproduced"] is None]
    assert len(missing) == 5 and all("arm missing" in c["measured"] for c in missing)


def test_markdown_lists_what_did_not_reproduce(tmp_path):
    data = {
        "spec": StudySpec(arms=("bf16", "naive")).validate().to_dict(),
        "parameters": 1e8,
        "sft": {"rows": [{"sft/token_accuracy": 0.7}], "done": True, "reached_target": True},
        "arms": {
            "bf16": {
                "label": "x | y",
                "done": True,
                "rows": [],
                "summary": report.arm_summary(rows([0.5] * 10, 0.01, 0.1)),
                "error": None,
            },
            "naive": {"label": "n", "done": False, "rows": [{}] * 3, "summary": None, "error": "RuntimeError: boom"},
        },
        "claims": [report._claim("c1", "p", "m1", False), report._claim("c2", "p", "m2", True)],
    }
    md = report.markdown(data)
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert all(len(re.split(r"(?<!\\)\|", line)) == 12 for line in table[:4])  # 10 cells, pipes escaped
    assert "## What did NOT reproduce\n\n- c1: m1 (paper: p)" in md
    assert "## What reproduced\n\n- c2: m2" in md
    assert "- naive: FAILED: RuntimeError: boom (3 steps)" in md


def test_the_gap_over_the_run_by_window():
    """report.arm_trend cuts an arm's steps into consecutive windows; the summary shows them per arm."""
    r = rows([0.1 * i for i in range(8)], 0.0, 0.0)
    for i, row in enumerate(r):
        row[report.GAP], row[report.GAP_MAX], row[report.ENTROPY] = float(i), 10.0 * i, 1.0 - 0.1 * i
    t = report.arm_trend(r)
    assert [(w["first_step"], w["last_step"]) for w in t] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [w["gap_mean"] for w in t] == [0.5, 2.5, 4.5, 6.5]
    assert [w["gap_max_mean"] for w in t] == [5.0, 25.0, 45.0, 65.0]
    assert [round(w["reward"], 6) for w in t] == [0.05, 0.25, 0.45, 0.65]
    assert [(w["first_step"], w["last_step"]) for w in report.arm_trend(r[:3])] == [(0, 0), (1, 1), (2, 2)]
    data = {
        "spec": StudySpec(arms=("naive",)).validate().to_dict(),
        "parameters": 1e8,
        "arms": {"naive": {"label": "n", "done": True, "rows": r, "summary": report.arm_summary(r), "error": None}},
        "claims": [],
    }
    md = report.markdown(data)
    assert "## The gap over the run" in md
    row = "| naive | 0-1 / 2-3 / 4-5 / 6-7 | 0.5000 / 2.5000 / 4.5000 / 6.5000 | 5.000 / 25.000 / 45.000 / 65.000 |"
    assert row in md


# ----------------------------------------------------------------------------- engine responses


def test_engine_responses_parse_into_tokens_and_logprobs():
    from quads_megatron.rl.rollout import parse_outputs

    out = [
        {"output_ids": [3, 4], "meta_info": {"output_token_logprobs": [(-0.1, 3, None), (-0.2, 4, None)]}},
        {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [(-0.3, 5, None), (-0.4, 6, None)]}},
    ]
    tokens, logp = parse_outputs(out, 2)
    assert tokens.tolist() == [[3, 4], [5, 6]] and torch.allclose(logp, torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]))
    with pytest.raises(RuntimeError, match="request 0: 2 output logprobs for 3 new tokens"):
        parse_outputs(out, 3)
    out[1]["output_ids"] = [5, 7]
    with pytest.raises(RuntimeError, match="request 1: output_ids"):
        parse_outputs(out, 2)


def test_engine_arguments_follow_the_arm():
    from quads_megatron.config import load_config
    from quads_megatron.rl.rollout import LOADER, engine_kwargs, rollout_yaml

    spec = StudySpec().validate()
    bf16 = engine_kwargs(ArmSpec.parse("bf16"), "/m", spec)
    q = engine_kwargs(ArmSpec.parse("rac25"), "/m", spec)
    assert "quantization" not in bf16 and q["quantization"] == "quads_nvfp4"
    for kw in (bf16, q):
        assert kw["custom_weight_loader"] == [LOADER] and kw["skip_tokenizer_init"] is True
        assert kw["attention_backend"] == "triton" and kw["sampling_backend"] == "pytorch"
        assert kw["disable_radix_cache"] is True and kw["grammar_backend"] == "none"
    import yaml

    rac = load_config(yaml.safe_load(rollout_yaml(ArmSpec.parse("rac25")))).rollout.rac
    assert rac.enabled and rac.ratio == 0.25 and rac.selection == "dynamic"
    assert not load_config(yaml.safe_load(rollout_yaml(ArmSpec.parse("naive")))).rollout.rac.enabled
