"""The run directory of a study: its spec, per-stage checkpoints and metrics, timings, and the time budget
of one piece. Every file is written atomically (a temporary file, then os.replace), so a piece killed at
any moment leaves the last checkpoint intact.

Layout::

    DIR/spec.json                the study spec; another spec is refused (QuadsError)
    DIR/timing.json              engine start, step and save times seen so far (the budget's estimates)
    DIR/sft/state.pt, done.json  the SFT warm-up: checkpoint, then its final weights and metrics
    DIR/sft/, DIR/arms/NAME/     progress.json: a stage's steps and metrics so far, with each checkpoint
    DIR/hf/, DIR/engine/         the engine's HF checkpoint (SFT weights) and its `quads convert` outputs
    DIR/arms/NAME/state.pt       an arm's checkpoint: trainer, RNG states, metrics, last batch
    DIR/arms/NAME/done.json      the arm's metrics and attribution once it finished (or its error)
    DIR/logs/                    one log per stage (GPU runs: the worker processes' output)
    DIR/summary/                 rl_summary.md / .json and the plots, rewritten after every piece
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from quads_megatron.errors import QuadsError
from quads_megatron.rl.spec import StudySpec, first_difference


class RunError(QuadsError):
    """A run directory that cannot be used for this study (another spec, unreadable files)."""


def write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=float)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str, default: Any = None) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        raise RunError(f"{path}: unreadable ({e})") from e


def save_torch(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_torch(path: str) -> Any:
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


class RunDir:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def stage_dir(self, stage: str) -> str:
        d = self.path("sft") if stage == "sft" else self.path("arms", stage)
        os.makedirs(d, exist_ok=True)
        return d

    # -- spec

    def init(self, spec: StudySpec) -> bool:
        """Create the directory for spec, or check that it holds a run of spec; True when resuming."""
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise RunError(f"{self.root}: exists and is not a directory")
        saved = read_json(self.path("spec.json"))
        if saved is not None:
            diff = first_difference(saved, json.loads(spec.fingerprint()))
            if diff:
                raise RunError(
                    f"{self.root} holds a run of another study ({diff}); pass the same arguments to resume it, "
                    "or choose a new --out"
                )
            return True
        if os.path.isdir(self.root) and os.listdir(self.root):
            raise RunError(f"{self.root}: not empty and not a `quads rl` run directory (no spec.json)")
        os.makedirs(self.root, exist_ok=True)
        write_json(self.path("spec.json"), json.loads(spec.fingerprint()))
        return False

    def spec(self) -> StudySpec:
        saved = read_json(self.path("spec.json"))
        if saved is None:
            raise RunError(f"{self.root}: no spec.json (not a `quads rl` run directory)")
        return StudySpec.from_dict(saved)

    # -- stages

    def done(self, stage: str) -> dict | None:
        """The stage's done.json (None while it has not finished)."""
        return read_json(os.path.join(self.stage_dir(stage), "done.json"))

    def progress(self, stage: str) -> dict:
        """The stage's progress.json, written at each checkpoint ({} before the first): step, rows, and for an
        arm engine_done (its steps and the attribution's engine batch are done)."""
        return read_json(os.path.join(self.stage_dir(stage), "progress.json"), {}) or {}

    def save_progress(self, stage: str, record: dict) -> None:
        write_json(os.path.join(self.stage_dir(stage), "progress.json"), record)

    def finish(self, stage: str, record: dict) -> None:
        write_json(os.path.join(self.stage_dir(stage), "done.json"), record)
        state = os.path.join(self.stage_dir(stage), "state.pt")
        if os.path.exists(state) and stage != "sft":
            os.remove(state)  # the optimizer state is not needed any more

    def load_state(self, stage: str) -> dict | None:
        return load_torch(os.path.join(self.stage_dir(stage), "state.pt"))

    def save_state(self, stage: str, state: dict) -> float:
        t0 = time.perf_counter()
        save_torch(os.path.join(self.stage_dir(stage), "state.pt"), state)
        seconds = time.perf_counter() - t0
        self.record_time("save_s", seconds)
        return seconds

    def sft_weights(self) -> dict[str, torch.Tensor]:
        w = load_torch(self.path("sft", "weights.pt"))
        if w is None:
            raise RunError(f"{self.root}: the SFT warm-up has no weights yet")
        return w

    # -- timings (the budget's estimates)

    def timing(self) -> dict[str, float]:
        return read_json(self.path("timing.json"), {})

    def record_time(self, key: str, seconds: float) -> None:
        """Keep the largest time seen for key (a conservative estimate for the next piece)."""
        t = self.timing()
        if seconds > t.get(key, 0.0):
            t[key] = seconds
            write_json(self.path("timing.json"), t)


class Budget:
    """The wall-clock budget of one piece: deadline is absolute (time.time()), shared with worker processes;
    piece_steps additionally stops after that many steps (tests, and manual chunking)."""

    def __init__(self, deadline: float | None, piece_steps: int | None = None) -> None:
        self.deadline, self.piece_steps, self.steps = deadline, piece_steps, 0

    @classmethod
    def seconds(cls, seconds: float | None, piece_steps: int | None = None) -> Budget:
        return cls(None if seconds is None else time.time() + seconds, piece_steps)

    def remaining(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def allows(self, seconds: float) -> bool:
        """Whether work estimated at seconds fits (and the piece's step quota is not used up)."""
        if self.piece_steps is not None and self.steps >= self.piece_steps:
            return False
        return self.remaining() >= seconds

    def step_done(self) -> None:
        self.steps += 1
