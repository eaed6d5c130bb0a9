"""`quads rl`: run (or resume) a study, write its summary. Arguments, defaults and the requirement check."""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

from quads_megatron.errors import QuadsError
from quads_megatron.rl.spec import MODEL_PRESETS, SpecError, StudySpec, parse_arms

EXIT_DONE, EXIT_FAILED, EXIT_UNFINISHED = 0, 1, 75

DESCRIPTION = """\
GRPO on a Megatron-Core MoE (Transformer Engine spec, TEGroupedMLP experts) with a colocated SGLang rollout
engine synced every step, comparing BF16, naive NVFP4 and QUADS (QAT + RAC) rollouts on a verifiable
synthetic task. Needs one GPU with Transformer Engine and SGLang; --dry-run runs a tiny study on the CPU
with a stand-in for the engine (the same sync stream and rollout math in torch)."""

EPILOG = """\
arms: bf16, naive, quads, racR (QAT + RAC R%), NAME-tis (truncated IS); presets main, sweep, all.
A study runs in pieces: with --budget-s S it stops before work that would not end within S seconds,
checkpointed; the same command resumes it (another spec in DIR is refused). A stage that overruns S anyway
is stopped within S + 30 s (allow a minute). Summary: DIR/summary/.

exit status: 0 done, 1 an arm failed (the others ran), 2 usage, 3 refused (one line says why),
75 stopped at the time budget with work left (run the same command again)."""

#: defaults that differ between a GPU study and the CPU dry run
GPU_DEFAULTS: dict = {}
DRY_RUN_DEFAULTS = dict(
    engine="emulate",
    arms="main",
    model="tiny",
    steps=4,
    prompts=4,
    group=4,
    digits=2,
    sft_steps=40,
    sft_target=0.95,
    sft_batch=64,
    sft_lr=3e-3,
    lr=1e-3,
    ckpt_every=2,
)
MODEL_FIELDS = ("layers", "experts", "topk", "hidden", "moe_ffn")
STUDY_FIELDS = (
    "steps",
    "prompts",
    "group",
    "lr",
    "digits",
    "task",
    "sft_steps",
    "sft_target",
    "sft_batch",
    "sft_lr",
    "seed",
    "micro_batch",
    "mem_fraction",
    "ckpt_every",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", required=True, metavar="DIR", help="run directory (created; resumed when it holds this study)"
    )
    p.add_argument("--arms", metavar="LIST", help="comma-separated arms and presets (default: all; dry run: main)")
    p.add_argument("--steps", type=int, metavar="N", help="GRPO steps per arm (default 150; dry run 4)")
    p.add_argument("--budget-s", type=float, metavar="S", help="wall-clock budget of this piece, in seconds")
    p.add_argument("--dry-run", action="store_true", help="tiny study on the CPU with the engine's stand-in")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), help="model preset (default h200; dry run tiny)")
    for f in MODEL_FIELDS:
        p.add_argument(f"--{f.replace('_', '-')}", type=int, metavar="N", help=f"override the preset's {f}")
    p.add_argument("--task", choices=("add", "sort"), help="verifiable task (default add)")
    p.add_argument("--digits", type=int, metavar="N", help="operand digits / list length (default 8)")
    p.add_argument("--prompts", type=int, metavar="N", help="prompts per GRPO step (default 32)")
    p.add_argument("--group", type=int, metavar="N", help="samples per prompt (default 8)")
    p.add_argument("--lr", type=float, help="GRPO learning rate (default 5e-5)")
    p.add_argument("--sft-steps", type=int, metavar="N", help="at most this many SFT warm-up steps (default 1500)")
    p.add_argument("--sft-target", type=float, metavar="ACC", help="stop SFT at this token accuracy (default 0.6)")
    p.add_argument("--sft-batch", type=int, metavar="N", help="SFT batch (default 256)")
    p.add_argument("--sft-lr", type=float, help="SFT learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, help="seed of the model init, the prompts and the sampling (default 0)")
    p.add_argument("--micro-batch", type=int, metavar="N", help="sequences per forward/backward (default 256)")
    p.add_argument("--mem-fraction", type=float, help="SGLang mem_fraction_static (default 0.2)")
    p.add_argument("--ckpt-every", type=int, metavar="N", help="checkpoint every N steps (default 50)")
    p.add_argument("--cuda-graph", action="store_true", help="let the engine capture decode CUDA graphs")
    p.add_argument("--no-attribution", action="store_true", help="skip the per-layer attribution")
    p.add_argument("--piece-steps", type=int, metavar="N", help="stop this piece after N steps (checkpointed)")
    p.add_argument("--report-only", action="store_true", help="rewrite DIR/summary from the run directory")


def build_spec(a: argparse.Namespace) -> StudySpec:
    """The StudySpec of parsed arguments (SpecError naming the flag of a bad value)."""
    base = dict(DRY_RUN_DEFAULTS) if a.dry_run else dict(GPU_DEFAULTS)
    model = MODEL_PRESETS[a.model or base.pop("model", "h200")]
    base.pop("model", None)
    over = {f: getattr(a, f) for f in MODEL_FIELDS if getattr(a, f) is not None}
    if over:
        model = dataclasses.replace(model, **over)
    kw = {k: v for k, v in base.items() if k != "arms"}
    kw |= {f: getattr(a, f) for f in STUDY_FIELDS if getattr(a, f) is not None}
    arms = parse_arms(a.arms or base.get("arms", "all"))
    return StudySpec(arms=arms, model=model, cuda_graph=a.cuda_graph, attribution=not a.no_attribution, **kw).validate()


def missing_for_gpu() -> str | None:
    """What a GPU study needs and this machine lacks (a CUDA GPU, Transformer Engine, a supported SGLang), or
    None. Looks without importing TE or SGLang: this process only orchestrates; the stage workers import
    them (and a TE build that does not load fails the first stage with the reason)."""
    from importlib.util import find_spec

    import torch

    from quads_megatron.integrations.sglang_versions import check_version

    if not torch.cuda.is_available():
        return "a CUDA GPU"
    if find_spec("transformer_engine") is None:
        return "Transformer Engine"
    if find_spec("sglang") is None:
        return "SGLang"
    try:
        check_version()
    except QuadsError as e:
        return f"a supported SGLang ({e})"
    return None


def main(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from quads_megatron.rl import report
    from quads_megatron.rl.runs import Budget, RunDir

    try:
        spec = build_spec(a)
    except SpecError as e:
        parser.error(str(e))
    rd = RunDir(a.out)
    if a.report_only:
        for path in report.write(rd):
            print(path)
        return EXIT_DONE
    if a.dry_run:  # megatron-core's notes that TE/Apex are absent, and CPU autocast's: expected on a CPU
        warnings.filterwarnings("ignore", module=r"megatron\..*")
        warnings.filterwarnings("ignore", message=".*Mismatch dtype between input and weight.*")
    else:
        missing = missing_for_gpu()
        if missing:
            raise QuadsError(
                f"a GPU study needs a CUDA GPU, Transformer Engine and SGLang; missing: {missing} "
                "(--dry-run runs a tiny study on the CPU with a stand-in for the engine)"
            )
    from quads_megatron.rl.study import run_study

    resumed = rd.init(spec)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:5.0f}s] {msg}", flush=True)

    log(
        f"{'resuming' if resumed else 'starting'} {rd.root}: arms {', '.join(spec.arms)}; "
        f"{spec.model.parameters() / 1e6:.1f}M parameters; engine {spec.engine}"
    )
    status = run_study(rd, spec, Budget.seconds(a.budget_s, a.piece_steps), log)
    paths = report.write(rd)
    for c in report.collect(rd)["claims"]:
        verdict = {True: "reproduced", False: "did NOT reproduce", None: "not measured"}[c["reproduced"]]
        log(f"{verdict}: {c['claim']}: {c['measured']}")
    log(f"{status}; summary: {', '.join(paths)}")
    if status == "unfinished":
        log("stopped at the time budget with work left: run the same command again to resume")
        return EXIT_UNFINISHED
    return EXIT_FAILED if status == "failed" else EXIT_DONE
