"""The study's summary: a markdown table and JSON of every arm, plots, and what did and did not reproduce
(each claim checked against the measured numbers; nothing in it is written by hand).

Written to DIR/summary/: rl_summary.md, rl_summary.json (spec, every step's metrics, attributions,
claims), rl_curves.png, rl_sweep.png, rl_attribution.png (when matplotlib is installed).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable
from typing import Any

from quads_megatron.rl.runs import RunDir, read_json, write_json
from quads_megatron.rl.spec import ArmSpec

GAP = "train/train_rollout_logprob_abs_diff"
GAP_MAX = "train/train_rollout_logprob_abs_diff_max"
REWARD = "rollout/raw_reward"
ENTROPY = "train/entropy_loss"
#: the paper's numbers (max |logp_rollout - logp_train|), for comparison only
PAPER = {
    "max_gap": {"naive": 1.3, "quads": 0.86, "bf16": 0.74},
    "rac_max_gap": {0.125: 0.923, 0.25: 0.901, 0.5: 0.854, 0.75: 0.812, 1.0: 0.759},
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def arm_summary(rows: list[dict]) -> dict[str, float]:
    """Per-arm numbers from its step rows: rewards over the first/last tenth of the steps, gaps over all."""
    n = len(rows)
    w = max(min(n, 2), n // 10)  # >= 2 steps where there are, so the last window has a standard error
    last = [r[REWARD] for r in rows[-w:]]
    se = statistics.stdev(last) / math.sqrt(len(last)) if len(last) > 1 else float("nan")
    col = lambda k: [r[k] for r in rows if k in r]  # noqa: E731
    return {
        "steps": n,
        "reward_first": _mean([r[REWARD] for r in rows[:w]]),
        "reward_last": _mean(last),
        "reward_last_se": se,
        "exact_last": _mean([r["rollout/exact_match"] for r in rows[-w:]]),
        "gap_mean": _mean(col(GAP)),
        "gap_max_mean": _mean(col(GAP_MAX)),
        "gap_max": max(col(GAP_MAX), default=float("nan")),
        "probs_diff_max": max(col("training/rollout_probs_diff_max"), default=float("nan")),
        "k3_kl": _mean(col("rollout_corr/k3_kl")),
        "kl": _mean(col("rollout_corr/kl")),
        "step_s": statistics.median(col("perf/step_s")) if rows else float("nan"),
    }


def arm_trend(rows: list[dict], parts: int = 4) -> list[dict[str, float]]:
    """The arm's step rows in `parts` consecutive windows (fewer if it has fewer steps): per window its first and
    last step, mean |gap|, mean per-step max gap, mean entropy and reward. Shows whether the gap grows as the
    policy sharpens (the paper's naive arm drifts, then collapses after ~150 steps)."""
    n, k = len(rows), min(parts, len(rows))
    windows = [rows[i * n // k : (i + 1) * n // k] for i in range(k)]

    def mean(w: list[dict], key: str) -> float:
        return _mean([r[key] for r in w if key in r])

    return [
        {
            "first_step": w[0]["step"],
            "last_step": w[-1]["step"],
            "gap_mean": mean(w, GAP),
            "gap_max_mean": mean(w, GAP_MAX),
            "entropy": mean(w, ENTROPY),
            "reward": mean(w, REWARD),
        }
        for w in windows
    ]


def collect(rd: RunDir) -> dict[str, Any]:
    """Everything the report shows, from the run directory (finished, running and failed stages)."""
    spec = rd.spec()
    out: dict[str, Any] = {"spec": spec.to_dict(), "parameters": spec.model.parameters(), "paper": PAPER, "arms": {}}
    for stage in ["sft", *spec.arms]:
        done = rd.done(stage)
        prog = rd.progress(stage)
        err = read_json(os.path.join(rd.stage_dir(stage), "error.json"))
        rows = (done or prog).get("rows", [])
        rec = {"done": done is not None, "rows": rows, "error": (err or {}).get("error")}
        if stage == "sft":
            rec["reached_target"] = (done or {}).get("reached_target")
            out["sft"] = rec
            continue
        arm = ArmSpec.parse(stage)
        rec |= {"label": arm.label, "rac_ratio": arm.rac_ratio, "qat": arm.qat, "rollout": arm.rollout}
        rec["lr"] = arm.learning_rate(spec.lr)
        rec["attribution"] = (done or {}).get("attribution")
        rec["summary"] = arm_summary(rows) if rows else None
        out["arms"][stage] = rec
    out["claims"] = claims({n: a["summary"] for n, a in out["arms"].items() if a["summary"]}, spec.arms)
    return out


def rac_sweep(names: Iterable[str]) -> list[tuple[float, str]]:
    """(RAC ratio, arm) of the QAT arms that differ only in their RAC ratio (no TIS, the study's lr), sorted."""
    return sorted((a.rac_ratio, n) for n in names if (a := ArmSpec.parse(n)).qat and not a.tis_cap and a.lr is None)


def _claim(text: str, paper: str, measured: str | None, ok: bool | None) -> dict:
    return {"claim": text, "paper": paper, "measured": measured or "not measured (arm missing)", "reproduced": ok}


def claims(s: dict[str, dict], arms: tuple[str, ...]) -> list[dict]:
    """Each claim of the paper / issue checked on the arm summaries (reproduced None: an arm it needs did
    not run, or too few steps for a standard error)."""
    out: list[dict] = []
    have = lambda *ns: all(n in s for n in ns)  # noqa: E731

    def se2(a: str, b: str) -> float:  # two standard errors of a difference of final rewards
        return 2 * math.hypot(s[a]["reward_last_se"], s[b]["reward_last_se"])

    def sure(ok: bool, margin: float) -> bool | None:
        return None if math.isnan(margin) else ok

    def add(text: str, paper: str, needs: tuple[str, ...], measure) -> None:
        if not have(*needs):
            out.append(_claim(text, paper, None, None))
            return
        measured, ok = measure()
        out.append(_claim(text, paper, measured, ok))

    def drift():
        r = s["naive"]["gap_mean"] / s["bf16"]["gap_mean"]
        rm = s["naive"]["gap_max_mean"] / s["bf16"]["gap_max_mean"]
        return f"mean |gap| naive/bf16 = {r:.2f}x, per-step max {rm:.2f}x", r > 1.2

    def below():
        q, n = s["quads"], s["naive"]
        m = f"mean |gap| {q['gap_mean']:.4f} vs {n['gap_mean']:.4f}; per-step max "
        m += f"{q['gap_max_mean']:.3f} vs {n['gap_max_mean']:.3f}"
        return m, q["gap_mean"] < n["gap_mean"] and q["gap_max_mean"] < n["gap_max_mean"]

    def closed():
        f = {k: (s["naive"][k] - s["quads"][k]) / (s["naive"][k] - s["bf16"][k]) for k in ("gap_mean", "gap_max_mean")}
        m = f"closed {f['gap_mean'] * 100:.0f}% (mean |gap|), {f['gap_max_mean'] * 100:.0f}% (per-step max)"
        return m, f["gap_mean"] >= 0.5

    def learns():
        b = s["bf16"]
        m = f"bf16 reward {b['reward_first']:.3f} -> {b['reward_last']:.3f} (2 s.e. {2 * b['reward_last_se']:.3f})"
        return m, sure(b["reward_last"] - b["reward_first"] > 2 * b["reward_last_se"], b["reward_last_se"])

    def better(a: str, b: str):
        def measure():
            d = s[a]["reward_last"] - s[b]["reward_last"]
            return f"{a} - {b} final reward = {d:+.3f} (2 s.e. {se2(a, b):.3f})", sure(d > se2(a, b), se2(a, b))

        return measure

    add(
        "naive NVFP4 rollout drifts above the BF16 floor (> 1.2x)",
        "max gap 1.3 vs 0.74 (1.76x)",
        ("naive", "bf16"),
        drift,
    )
    add("QUADS (QAT + RAC 50%) keeps the gap below naive NVFP4", "max gap 0.86 vs 1.3", ("quads", "naive"), below)
    add(
        "QUADS closes at least half of naive's excess gap over the BF16 floor",
        "(1.3 - 0.86) / (1.3 - 0.74) = 79% of the max gap",
        ("quads", "naive", "bf16"),
        closed,
    )
    sweep = rac_sweep(s)

    def monotone():
        gaps = [s[n]["gap_mean"] for _, n in sweep]
        inversions = sum(b >= a for a, b in zip(gaps, gaps[1:], strict=False))
        m = ", ".join(f"{r * 100:g}%: {g:.4f}" for (r, _), g in zip(sweep, gaps, strict=True))
        return f"{m} ({inversions} inversions)", inversions == 0

    add(
        "a larger RAC ratio gives a smaller gap (QAT trainer, >= 3 ratios)",
        "12.5/25/50/75/100% -> 0.923/0.901/0.854/0.812/0.759",
        tuple(n for _, n in sweep) if len(sweep) >= 3 else ("rac-sweep",),
        monotone,
    )
    add("the policy improves under RL (BF16 rollout)", "-", ("bf16",), learns)
    add(
        "naive NVFP4 rollout degrades RL (final reward below BF16's)",
        "RL degrades",
        ("bf16", "naive"),
        better("bf16", "naive"),
    )
    add(
        "QUADS recovers RL (final reward above naive NVFP4's)",
        "QUADS keeps RL at BF16 quality",
        ("quads", "naive"),
        better("quads", "naive"),
    )
    if "naive-tis" in arms:
        add(
            "TIS recovers part of naive NVFP4's RL",
            "(optional arm)",
            ("naive-tis", "naive"),
            better("naive-tis", "naive"),
        )
    return out


# ----------------------------------------------------------------------------- markdown


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(data: dict) -> str:
    spec, m = data["spec"], data["spec"]["model"]
    lines = [
        "# quads rl: summary",
        "",
        f"Model: Megatron-Core GPTModel, {m['layers']} layers, {m['experts']} experts top-{m['topk']}, hidden "
        f"{m['hidden']}, {data['parameters'] / 1e6:.0f}M parameters; task {spec['task']} ({spec['digits']} digits); "
        f"{spec['steps']} GRPO steps x {spec['prompts']} prompts x {spec['group']} samples, lr {spec['lr']:g} (an arm "
        f"named NAME@LR: its own); rollout engine "
        f"{'SGLang' if spec['engine'] == 'sglang' else 'CPU stand-in (emulate: not an engine)'}.",
        "",
    ]
    sft = data.get("sft", {})
    if sft.get("rows"):
        acc = sft["rows"][-1]["sft/token_accuracy"]
        lines += [
            f"SFT warm-up: {len(sft['rows'])} steps, last token accuracy {acc:.3f} (target "
            f"{spec['sft_target']}: {'reached' if sft.get('reached_target') else 'not reached'}).",
            "",
        ]
    head = [
        "arm",
        "what",
        "steps",
        "reward first -> last",
        "exact last",
        "mean abs gap",
        "max gap (mean / max)",
        "probs diff max",
        "k3 KL",
        "s/step",
    ]
    lines += ["## Arms", "", _row(head), _row(["---"] * len(head))]
    for name, a in data["arms"].items():
        s = a["summary"]
        if s is None:
            lines.append(_row([name, a["label"], "0", *["-"] * (len(head) - 3)]))
            continue
        lines.append(
            _row(
                [
                    name,
                    a["label"],
                    f"{s['steps']}{'' if a['done'] else ' (running)'}",
                    f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}",
                    f"{s['exact_last']:.3f}",
                    f"{s['gap_mean']:.4f}",
                    f"{s['gap_max_mean']:.3f} / {s['gap_max']:.3f}",
                    f"{s['probs_diff_max']:.3f}",
                    f"{s['k3_kl']:.2e}",
                    _f(s["step_s"], ".2f"),
                ]
            )
        )
    lines += ["", "Gaps are |logp_rollout - logp_train| of the sampled tokens (see docs/rl.md for every metric)."]
    lines += _trend_table(data)
    attr = {n: a["attribution"] for n, a in data["arms"].items() if a.get("attribution")}
    for name, at in attr.items():
        lines += [
            "",
            f"## Per-layer attribution: {name}",
            "",
            f"Engine gap {at['engine_gap']:.4f}; the trainer's emulation of the rollout numerics (all layers) "
            f"{at['emulated_gap']:.4f} ({at['emulated_vs_engine']:.4f} from the engine).",
            "",
            _row(
                [
                    "layer",
                    "gap, this layer only",
                    "gap, this layer BF16",
                    "share",
                    "fc1 input rel err",
                    "fc2 input rel err",
                ]
            ),
            _row(["---"] * 6),
        ]
        for r in at["layers"]:
            lines.append(
                _row(
                    [
                        str(r["layer"]),
                        f"{r['gap_only']:.4f}",
                        f"{r['gap_without']:.4f}",
                        f"{r['share'] * 100:.0f}%",
                        f"{r['fc1_rel_err']:.2e}",
                        f"{r['fc2_rel_err']:.2e}",
                    ]
                )
            )
    good = [c for c in data["claims"] if c["reproduced"]]
    bad = [c for c in data["claims"] if c["reproduced"] is False]
    missing = [c for c in data["claims"] if c["reproduced"] is None]
    item = lambda c: f"- {c['claim']}: {c['measured']} (paper: {c['paper']})"  # noqa: E731
    lines += ["", "## What reproduced", ""] + ([item(c) for c in good] or ["- nothing"])
    lines += ["", "## What did NOT reproduce", ""] + ([item(c) for c in bad] or ["- nothing"])
    problems = [
        f"- {n}: {'FAILED: ' + a['error'] if a['error'] else 'incomplete'} ({len(a['rows'])} steps)"
        for n, a in data["arms"].items()
        if not a["done"]
    ]
    if missing or problems or not sft.get("done"):
        lines += ["", "## Not measured", ""] + [f"- {c['claim']}: {c['measured']}" for c in missing] + problems
        if not sft.get("done"):
            lines.append(f"- SFT warm-up {'FAILED: ' + sft['error'] if sft.get('error') else 'incomplete'}")
    return "\n".join(lines) + "\n"


def _trend_table(data: dict) -> list[str]:
    """The "gap over the run" section: one row per arm, each cell its windows' values (arm_trend)."""
    trends = {n: arm_trend(rows) for n, a in data["arms"].items() if (rows := [r for r in a["rows"] if "step" in r])}
    if not trends:
        return []
    head = ["arm", "steps", "mean abs gap", "max gap per step", "entropy", "reward"]

    def cells(t: list[dict], key: str, fmt: str) -> str:
        return " / ".join(_f(w[key], fmt) for w in t)

    lines = [
        "",
        "## The gap over the run",
        "",
        "Each arm's steps in consecutive windows (values separated by /): does the gap grow as the policy sharpens?",
        "",
        _row(head),
        _row(["---"] * len(head)),
    ]
    for name, t in trends.items():
        steps = " / ".join(f"{w['first_step']}-{w['last_step']}" for w in t)
        lines.append(
            _row(
                [
                    name,
                    steps,
                    cells(t, "gap_mean", ".4f"),
                    cells(t, "gap_max_mean", ".3f"),
                    cells(t, "entropy", ".3f"),
                    cells(t, "reward", ".3f"),
                ]
            )
        )
    return lines


# ----------------------------------------------------------------------------- plots


def _smooth(ys: list[float], w: int) -> list[float]:
    return [_mean(ys[max(0, i - w + 1) : i + 1]) for i in range(len(ys))]


def plots(data: dict, out_dir: str) -> list[str]:
    """rl_curves.png, rl_sweep.png, rl_attribution.png; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    arms = {n: a for n, a in data["arms"].items() if a["rows"]}
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    panels = [
        (REWARD, "Reward (fraction of right answer digits)", "reward, moving mean of 10 steps", 10, False),
        (GAP, "Mean |logp_rollout - logp_train|", "train_rollout_logprob_abs_diff", 1, True),
        (GAP_MAX, "Max |logp_rollout - logp_train| per step", "max over the step's tokens", 1, True),
        ("rollout_corr/k3_kl", "k3 KL(rollout || train)", "rollout_corr/k3_kl", 1, True),
    ]
    for ax, (key, title, ylabel, w, log) in zip(axes.flat, panels, strict=True):
        for name, a in arms.items():
            xs = [r["step"] for r in a["rows"]]
            ax.plot(xs, _smooth([r[key] for r in a["rows"]], w), label=name, lw=1.2)
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
    axes[0, 0].legend(title="arm", fontsize=8)
    fig.suptitle("quads rl: BF16 vs naive NVFP4 vs QUADS rollout")
    fig.tight_layout()
    written.append(os.path.join(out_dir, "rl_curves.png"))
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    sweep = rac_sweep(n for n, a in arms.items() if a["summary"])
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r * 100 for r, _ in sweep]
        ax.plot(xs, [arms[n]["summary"]["gap_mean"] for _, n in sweep], "o-", label="mean |gap| (QAT + RAC)")
        ax.plot(xs, [arms[n]["summary"]["gap_max_mean"] for _, n in sweep], "s-", label="per-step max |gap|")
        for ref, style in (("naive", ":"), ("bf16", "--")):
            if ref in arms and arms[ref]["summary"]:
                ax.axhline(arms[ref]["summary"]["gap_mean"], ls=style, c="gray", label=f"{ref}: mean |gap|")
        ax.set_xlabel("RAC ratio (% of K compensated)")
        ax.set_ylabel("|logp_rollout - logp_train| (this run)")
        ax.set_yscale("log")
        ax2 = ax.twinx()
        px = sorted(PAPER["rac_max_gap"])
        ax2.plot(
            [p * 100 for p in px], [PAPER["rac_max_gap"][p] for p in px], "x--", c="tab:red", label="paper max gap"
        )
        ax2.set_ylabel("paper: max gap", color="tab:red")
        handles = ax.get_legend_handles_labels()
        extra = ax2.get_legend_handles_labels()
        ax.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=8, loc="upper right")
        ax.set_title("RAC ratio sweep")
        fig.tight_layout()
        written.append(os.path.join(out_dir, "rl_sweep.png"))
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    attr = {n: a["attribution"] for n, a in arms.items() if a.get("attribution")}
    if attr:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / len(attr)
        for i, (name, at) in enumerate(attr.items()):
            layers = [r["layer"] for r in at["layers"]]
            ax.bar([x + i * width for x in layers], [r["gap_only"] for r in at["layers"]], width, label=name)
        layers = [r["layer"] for r in next(iter(attr.values()))["layers"]]
        ax.set_xticks([x + (len(attr) - 1) * width / 2 for x in layers], [str(x) for x in layers])
        ax.set_xlabel("MoE layer (Megatron layer number)")
        ax.set_ylabel("mean |gap| with only this layer NVFP4")
        ax.set_title("Per-layer attribution (trainer emulation of the rollout numerics)")
        ax.legend(title="arm", fontsize=8)
        fig.tight_layout()
        written.append(os.path.join(out_dir, "rl_attribution.png"))
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


def write(rd: RunDir) -> list[str]:
    """Collect, then write the summary files into DIR/summary; returns their paths."""
    data = collect(rd)
    out_dir = rd.path("summary")
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "rl_summary.json"), data)
    md = os.path.join(out_dir, "rl_summary.md")
    tmp = md + ".tmp"
    with open(tmp, "w") as f:
        f.write(markdown(data))
    os.replace(tmp, md)
    return [os.path.join(out_dir, "rl_summary.json"), md, *plots(data, out_dir)]
