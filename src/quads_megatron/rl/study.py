"""A `quads rl` study: the SFT warm-up, then each arm's GRPO run from the SFT weights, in order, resumable.

run_study() is the orchestrator. With the SGLang engine each stage runs in a worker process (this module
as ``python -m quads_megatron.rl.study RUN_DIR STAGE --deadline T``): the worker holds the trainer and
the engine on the GPU, so a stage that fails (or is killed at the deadline) leaves the study and the other
arms running, and its GPU memory is freed when it exits. With the CPU stand-in (``engine: emulate``) the
stages run in this process. A piece stops before any step that its time budget cannot fit, checkpoints,
and the next invocation resumes there.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch

from quads_megatron.rl import grpo
from quads_megatron.rl.runs import Budget, RunDir, read_json, save_torch, write_json
from quads_megatron.rl.spec import ArmSpec, StudySpec
from quads_megatron.rl.task import Task

Log = Callable[[str], None]
#: estimates before anything was measured, per engine kind, in seconds: start (the stage's process launched
#: until its first step can begin: imports, Megatron, the trainer, its weights and, for an arm, the engine),
#: first step of a process (warm-up: kernels compile), later steps, save, engine_stop (the engine's
#: shutdown), stop (from the stage's closing mark, its last act, until its process has exited)
DEFAULTS = {
    "sglang": {
        "start_s": 100.0,
        "sft_start_s": 40.0,
        "first_step_s": 30.0,
        "step_s": 10.0,
        "save_s": 5.0,
        "engine_stop_s": 15.0,
        "stop_s": 10.0,
    },
    "emulate": {
        "start_s": 3.0,
        "sft_start_s": 1.0,
        "first_step_s": 2.0,
        "step_s": 2.0,
        "save_s": 0.5,
        "engine_stop_s": 0.2,
        "stop_s": 0.3,
    },
}
SFT_WARMUP = 50  # the SFT learning rate rises linearly over this many steps (a quarter of sft_steps at most)
SFT_WINDOW = 5  # the SFT target is met when the mean token accuracy of this many last steps reaches it
LOG_EVERY = 10


def stages(spec: StudySpec) -> list[str]:
    return ["sft", *spec.arms]


def estimate(rd: RunDir, spec: StudySpec, key: str) -> float:
    """The largest time seen for key in this run directory, else the engine kind's default (an sft_ key
    without its own default takes the arms')."""
    defaults = DEFAULTS[spec.engine]
    return rd.timing().get(key, defaults.get(key, defaults.get(key.replace("sft_", ""))))


def mark_closing(rd: RunDir, stage: str) -> None:
    """The stage's last act (after its engine's shutdown): the orchestrator times stop_s, the process's exit,
    from it."""
    write_json(os.path.join(rd.stage_dir(stage), "closing.json"), {"t": time.time()})


def record_stop(rd: RunDir, stage: str, since: float) -> None:
    """stop_s: from the stage's closing mark until now (its process has exited); the mark is consumed. A mark
    older than since (the stage's launch: left by a piece that was itself stopped) is dropped unread."""
    path = os.path.join(rd.stage_dir(stage), "closing.json")
    mark = read_json(path)
    if mark is not None:
        if float(mark["t"]) >= since:
            rd.record_time("stop_s", time.time() - float(mark["t"]))
        os.remove(path)


class StepClock:
    """What the next step may take: the first step of a process (warm-up) apart from the others, which are
    estimated by the slowest of the last 20 seen here (or the run directory's record before any)."""

    def __init__(self, rd: RunDir, spec: StudySpec, prefix: str = "") -> None:
        self.rd, self.prefix = rd, prefix
        self.first = estimate(rd, spec, f"{prefix}first_step_s")
        self.later = estimate(rd, spec, f"{prefix}step_s")
        self.stop = estimate(rd, spec, "save_s") + estimate(rd, spec, "stop_s")
        if not prefix:  # an arm's engine shuts down too
            self.stop += estimate(rd, spec, "engine_stop_s")
        self.seen: list[float] = []
        self.n = 0

    def need(self) -> float:
        """Seconds to keep before starting the next step: 1.5 x its estimate, then a save and a stop."""
        step = self.first if self.n == 0 else (max(self.seen[-20:]) if self.seen else self.later)
        return 1.5 * step + self.stop

    def record(self, seconds: float) -> None:
        self.rd.record_time(f"{self.prefix}{'first_' if self.n == 0 else ''}step_s", seconds)
        if self.n:
            self.seen.append(seconds)
        self.n += 1


def _device(spec: StudySpec) -> str:
    """Megatron's one-process world (re-initialized per stage: cheap, and robust to whatever ran before)."""
    from quads_megatron.rl.trainer import setup_megatron

    return setup_megatron(spec.seed)


# ----------------------------------------------------------------------------- stages (run in the worker)


def run_sft(rd: RunDir, spec: StudySpec, budget: Budget, log: Log, launched: float) -> bool:
    """The supervised warm-up until sft_target or sft_steps; True when finished. launched: time.time() when
    the stage's process started (sft_start_s is timed from it)."""
    from quads_megatron.rl.trainer import Trainer, export_hf

    device = _device(spec)
    task = Task(spec.task, spec.digits)
    gen = torch.Generator().manual_seed(spec.seed + 100)
    trainer = Trainer(spec.model, device, spec.seed, spec.sft_lr)
    state = rd.load_state("sft")
    rows: list[dict] = []
    if state is not None:
        trainer.load_state_dict(state["trainer"])
        rows = state["rows"]
        gen.set_state(state["task_rng"])
    clock = StepClock(rd, spec, "sft_")
    rd.record_time("sft_start_s", time.time() - launched)

    def reached() -> bool:
        last = rows[-SFT_WINDOW:]
        return len(last) == SFT_WINDOW and sum(r["sft/token_accuracy"] for r in last) / SFT_WINDOW >= spec.sft_target

    while len(rows) < spec.sft_steps and not reached():
        if not budget.allows(clock.need()):
            rd.save_state("sft", {"trainer": trainer.state_dict(), "rows": rows, "task_rng": gen.get_state()})
            rd.save_progress("sft", {"step": len(rows), "rows": rows})
            log(f"sft: stopped at the time budget after {len(rows)} steps (checkpointed)")
            mark_closing(rd, "sft")
            return False
        t0 = time.perf_counter()
        trainer.opt.set_lr(spec.sft_lr * min(1.0, (len(rows) + 1) / max(1, min(SFT_WARMUP, spec.sft_steps // 4))))
        prompts, truth = task.sample(spec.sft_batch, gen)
        row = {"step": len(rows), **trainer.sft_step(prompts, truth, spec.micro_batch, spec.grad_clip)}
        rows.append(row)
        budget.step_done()
        clock.record(time.perf_counter() - t0)
        if len(rows) % (LOG_EVERY * 5) == 0 or len(rows) == 1:
            log(f"sft step {len(rows)}: loss {row['sft/loss']:.3f}, token accuracy {row['sft/token_accuracy']:.3f}")
    save_torch(rd.path("sft", "weights.pt"), trainer.weights())
    if spec.engine == "sglang":
        export_hf(trainer.model, spec.model, rd.path("hf"))
    rd.finish("sft", {"rows": rows, "steps": len(rows), "reached_target": reached()})
    log(f"sft: done after {len(rows)} steps (target {spec.sft_target} {'reached' if reached() else 'NOT reached'})")
    mark_closing(rd, "sft")
    return True


def make_rollout(arm: ArmSpec, spec: StudySpec, rd: RunDir):
    if spec.engine == "emulate":
        from quads_megatron.rl.emulate import EmulatedRollout

        return EmulatedRollout(arm, spec)
    from quads_megatron.rl.rollout import SglangRollout, engine_checkpoint

    return SglangRollout(arm, engine_checkpoint(arm, rd.path("hf"), rd.path("engine")), spec)


def attribution_batch(trainer, rollout, task: Task, spec: StudySpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences, rollout logprobs) of held-out prompts sampled by the engine at the trainer's weights."""
    rollout.sync(trainer.model)
    prompts, _ = task.sample(spec.prompts, torch.Generator().manual_seed(spec.seed + 3))
    prompts = prompts.repeat_interleave(spec.group, 0)
    answers, logp = rollout.generate(prompts, task.answer_len)
    return torch.cat([prompts, answers], 1), logp


def rl_step(trainer, rollout, task: Task, gen: torch.Generator, spec: StudySpec, arm: ArmSpec, step: int) -> dict:
    """Sync, sample, score, update; returns the step's metrics row."""
    t0 = time.perf_counter()
    row: dict = {"step": step, **rollout.sync(trainer.model)}
    prompts, truth = task.sample(spec.prompts, gen)
    prompts, truth = prompts.repeat_interleave(spec.group, 0), truth.repeat_interleave(spec.group, 0)
    t1 = time.perf_counter()
    answers, logp_rollout = rollout.generate(prompts, task.answer_len)
    t2 = time.perf_counter()
    reward, exact = task.score(answers, truth)
    seqs = torch.cat([prompts, answers], 1)
    adv = grpo.group_advantages(reward, spec.group)
    metrics, logp_train = trainer.grpo_step(
        seqs, task.prompt_len, logp_rollout, adv, spec.clip, arm.tis_cap, spec.micro_batch, spec.grad_clip
    )
    t3 = time.perf_counter()
    row |= {
        "rollout/raw_reward": float(reward.mean()),
        "rollout/exact_match": float(exact.float().mean()),
        **grpo.mismatch_metrics(logp_train, logp_rollout),
        **metrics,
        "perf/sync_s": t1 - t0,
        "perf/rollout_s": t2 - t1,
        "perf/train_s": t3 - t2,
        "perf/step_s": t3 - t0,
    }
    return row


def run_arm(rd: RunDir, spec: StudySpec, name: str, budget: Budget, log: Log, launched: float) -> bool:
    """One arm's GRPO run (resumed from its checkpoint), then its attribution; True when finished. launched:
    time.time() when the stage's process started (start_s is timed from it)."""
    from quads_megatron.rl.trainer import Trainer

    device = _device(spec)
    arm, task = spec.arm(name), Task(spec.task, spec.digits)
    gen = torch.Generator().manual_seed(spec.seed + 1)  # every arm sees the same prompts
    clock = StepClock(rd, spec)
    trainer = Trainer(spec.model, device, spec.seed, arm.learning_rate(spec.lr), qat=arm.qat)
    rollout = None

    def close_rollout() -> None:  # timed: engine_stop_s
        nonlocal rollout
        if rollout is not None:
            t0 = time.perf_counter()
            rollout.close()
            rollout = None
            rd.record_time("engine_stop_s", time.perf_counter() - t0)

    try:
        state = rd.load_state(name)
        rows: list[dict] = []
        last = None
        if state is None:
            trainer.load_weights(rd.sft_weights())
        else:
            trainer.load_state_dict(state["trainer"])
            rows, last = state["rows"], state["last"]
            gen.set_state(state["task_rng"])

        def save() -> None:
            rd.save_state(
                name,
                {
                    "trainer": trainer.state_dict(),
                    "rows": rows,
                    "last": last,
                    "task_rng": gen.get_state(),
                    "rollout_rng": rollout.rng_state() if rollout is not None else state_rng,
                },
            )
            rd.save_progress(
                name, {"step": len(rows), "rows": rows, "engine_done": len(rows) >= spec.steps and last is not None}
            )

        state_rng = state["rollout_rng"] if state is not None else {}
        wants_attribution = spec.attribution and arm.rollout == "nvfp4"
        if len(rows) < spec.steps or (wants_attribution and last is None):
            t0 = time.perf_counter()
            rollout = make_rollout(arm, spec, rd)  # (converts the engine's checkpoint the first time)
            rollout.set_rng_state(state_rng)
            rd.record_time("engine_start_s", time.perf_counter() - t0)
            rd.record_time("start_s", time.time() - launched)
            log(f"{name}: {arm.label}; rollout ready in {time.perf_counter() - t0:.1f} s, from step {len(rows)}")
        while len(rows) < spec.steps:
            if not budget.allows(clock.need()):
                save()
                log(f"{name}: stopped at the time budget after step {len(rows)} (checkpointed)")
                return False
            row = rl_step(trainer, rollout, task, gen, spec, arm, len(rows))
            rows.append(row)
            budget.step_done()
            clock.record(row["perf/step_s"])
            if len(rows) % LOG_EVERY == 0 or len(rows) in (1, spec.steps):
                log(step_line(name, row, spec.steps))
            if len(rows) % spec.ckpt_every == 0 and len(rows) < spec.steps:
                save()
        if wants_attribution and last is None:  # a held-out batch sampled by the final weights
            if not budget.allows(clock.need()):
                save()
                log(f"{name}: all steps done; the attribution waits for the next piece (checkpointed)")
                return False
            last = attribution_batch(trainer, rollout, task, spec)
        close_rollout()
        attribution = None
        if wants_attribution:
            from quads_megatron.rl.attribution import attribute

            if not budget.allows(clock.need()):
                save()
                log(f"{name}: all steps done; the attribution waits for the next piece (checkpointed)")
                return False
            attribution = attribute(trainer.model, last[0], task.prompt_len, last[1], arm, spec.micro_batch)
        rd.finish(name, {"arm": name, "label": arm.label, "rows": rows, "attribution": attribution})
        log(f"{name}: done ({len(rows)} steps)")
        return True
    finally:
        close_rollout()
        trainer.close()
        mark_closing(rd, name)


def step_line(name: str, row: dict, steps: int) -> str:
    return (
        f"{name} step {row['step'] + 1}/{steps}: reward {row['rollout/raw_reward']:.3f} "
        f"(exact {row['rollout/exact_match']:.3f}), |logp gap| mean "
        f"{row['train/train_rollout_logprob_abs_diff']:.4f} max {row['train/train_rollout_logprob_abs_diff_max']:.3f}, "
        f"k3 {row['rollout_corr/k3_kl']:.2e}, {row['perf/step_s']:.2f} s"
    )


def run_stage(rd: RunDir, spec: StudySpec, stage: str, budget: Budget, log: Log, launched: float | None = None) -> bool:
    """One stage here; an exception is recorded in the stage's error.json (the next piece retries it).
    launched: when the stage's process started (default now: the stage runs in this process)."""
    err = os.path.join(rd.stage_dir(stage), "error.json")
    launched = time.time() if launched is None else launched
    try:
        if stage == "sft":
            ok = run_sft(rd, spec, budget, log, launched)
        else:
            ok = run_arm(rd, spec, stage, budget, log, launched)
    except Exception as e:  # recorded; the study goes on with the next arm
        write_json(err, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-6000:]})
        log(f"{stage}: FAILED: {type(e).__name__}: {e}")
        return False
    if os.path.exists(err):
        os.remove(err)
    return ok


# ----------------------------------------------------------------------------- orchestration


def progress(rd: RunDir, stage: str) -> int:
    done = rd.done(stage)
    if done is not None:
        return len(done.get("rows", []))
    return int(rd.progress(stage).get("step", 0))


#: a worker still running this long past the deadline is stopped (SIGTERM, SIGKILL KILL_AFTER_S later): a
#: piece given --budget-s S ends within S + GRACE_S + KILL_AFTER_S + the summary's few seconds
GRACE_S = 20.0
KILL_AFTER_S = 10.0


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group (it, the engine's scheduler), SIGKILL KILL_AFTER_S later."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def worker_failure(returncode: int, log_text: str) -> dict:
    """error.json of a worker that died without writing one. A failure inside SGLang's scheduler (e.g. a
    refused weight update) kills the whole worker tree first; its traceback is then in the log."""
    at = log_text.rfind("Scheduler hit an exception")
    if at >= 0:
        return {
            "error": f"worker exited with {returncode}; SGLang's scheduler failed first (its traceback below)",
            "traceback": log_text[at : at + 6000],
        }
    return {"error": f"worker exited with {returncode}", "traceback": log_text[-6000:]}


def run_in_worker(rd: RunDir, stage: str, budget: Budget, log: Log) -> None:
    """The stage in a worker process (own process group, killed as a group past the deadline + grace)."""
    os.makedirs(rd.path("logs"), exist_ok=True)
    launched = time.time()
    cmd = [sys.executable, "-m", "quads_megatron.rl.study", rd.root, stage, "--launched", repr(launched)]
    if budget.deadline is not None:
        cmd += ["--deadline", repr(budget.deadline)]
    if budget.piece_steps is not None:
        cmd += ["--piece-steps", str(max(0, budget.piece_steps - budget.steps))]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_INTERPRET="0")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # fixed cuBLAS workspaces: reproducible GEMMs
    before = progress(rd, stage)
    log_path = rd.path("logs", f"{stage}.log")
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0

    def terminated(signum, frame):  # `timeout` or a user stopping this piece: stop the worker's group too
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    with open(log_path, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0)
        stopped = False
        try:
            proc.wait(timeout=None if budget.deadline is None else max(1.0, budget.remaining() + GRACE_S))
        except subprocess.TimeoutExpired:
            stopped = True
            log(f"{stage}: the worker outlived the deadline by {GRACE_S:.0f} s; stopping it")
        finally:
            signal.signal(signal.SIGTERM, previous)
            if proc.poll() is None:
                stop_group(proc)
    if stopped and progress(rd, stage) == before:  # stopped before its first step: its start took at least this
        rd.record_time("sft_start_s" if stage == "sft" else "start_s", time.time() - launched)
    budget.steps += max(0, progress(rd, stage) - before)
    with open(log_path, errors="replace") as f:
        f.seek(offset)
        text = f.read()
    for line in text.splitlines():  # the worker's own lines (SGLang's stay in the log file)
        if line.startswith("[") and "s] " in line[:24]:
            print(f"  | {line}", flush=True)
    err = os.path.join(rd.stage_dir(stage), "error.json")
    if proc.returncode != 0 and not os.path.exists(err):
        write_json(err, worker_failure(proc.returncode, text))
    if os.path.exists(err):  # what went wrong, in the piece's own output
        rec = read_json(err)
        log(f"{stage}: FAILED: {rec.get('error')} (log: {log_path})")
        print("\n".join(f"  ! {x}" for x in str(rec.get("traceback", "")).splitlines()[-25:]), flush=True)


def run_study(rd: RunDir, spec: StudySpec, budget: Budget, log: Log, workers: bool | None = None) -> str:
    """Run what is left of the study within the budget: 'done', 'unfinished' or 'failed'. workers: stages
    in worker processes (default: with the SGLang engine, not with the CPU stand-in)."""
    workers = spec.engine == "sglang" if workers is None else workers
    failed = False
    for stage in stages(spec):
        if rd.done(stage) is not None:
            continue
        started = progress(rd, stage) > 0
        # an arm whose steps and attribution batch are done needs no engine any more (the attribution is
        # the trainer's): it starts like the SFT stage
        engine = stage != "sft" and not rd.progress(stage).get("engine_done", False)
        first = estimate(rd, spec, "sft_first_step_s" if stage == "sft" else "first_step_s")
        need = estimate(rd, spec, "start_s" if engine else "sft_start_s") + 1.5 * first
        need += estimate(rd, spec, "save_s") + estimate(rd, spec, "stop_s")
        if engine:
            need += estimate(rd, spec, "engine_stop_s")
        if not budget.allows(need):
            log(f"time budget: {budget.remaining():.0f} s left, {stage} needs ~{need:.0f} s; run again to resume")
            return "unfinished"
        left = "" if budget.deadline is None else f" ({budget.remaining():.0f} s of budget left)"
        log(f"{stage}: {'resuming' if started else 'starting'}{left}")
        launched = time.time()
        if workers:
            run_in_worker(rd, stage, budget, log)
        else:
            run_stage(rd, spec, stage, budget, log)
        record_stop(rd, stage, launched)
        if rd.done(stage) is None:
            if os.path.exists(os.path.join(rd.stage_dir(stage), "error.json")):
                failed = True
                if stage == "sft":
                    return "failed"
                continue
            return "unfinished"
    return "failed" if failed else "done"


def worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one stage of a `quads rl` study (started by quads rl)")
    p.add_argument("run_dir")
    p.add_argument("stage")
    p.add_argument("--deadline", type=float, default=None)
    p.add_argument("--piece-steps", type=int, default=None)
    p.add_argument("--launched", type=float, default=None, help="time.time() when the orchestrator started it")
    a = p.parse_args(argv)
    rd = RunDir(a.run_dir)
    spec = rd.spec()
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:5.0f}s] {msg}", flush=True)

    run_stage(rd, spec, a.stage, Budget(a.deadline, a.piece_steps), log, a.launched)
    failed = os.path.exists(os.path.join(rd.stage_dir(a.stage), "error.json"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(worker_main())
