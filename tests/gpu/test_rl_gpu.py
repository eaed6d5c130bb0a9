"""`quads rl` on the real stack (H200): a tiny study through the CLI, as a user runs it. A Megatron GPTModel with
the Transformer Engine spec (TEGroupedMLP experts) trains; an SGLang engine on the same GPU rolls out, synced
in place every step through the quads loader; arms bf16 (unquantized engine, BF16 sync), naive (quads_nvfp4
RAC off, packed NVFP4 sync from a BF16 trainer) and quads (QAT trainer, RAC 50%). Skipped without CUDA,
Transformer Engine or SGLang.

Checks: the study finishes, every metric is finite, the engine's logprobs line up with the trainer's (a
misaligned or stale sync gives gaps of nats, not hundredths), NVFP4 arms drift more than the BF16 floor.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from quads_megatron.rl.command import EXIT_UNFINISHED, missing_for_gpu

#: the study's arguments; dev/device/run.sh's rl-smoke part runs the same (in pieces, across calls if needed)
SMOKE_ARGS = ["--model", "smoke", "--arms", "main", "--steps", "3", "--sft-steps", "20", "--prompts", "8",
              "--group", "4", "--digits", "3"]  # fmt: skip
#: a run directory to resume (e.g. rl-smoke's) instead of a new one: three engine starts and the SFT may not
#: fit one piece
RUN_DIR_ENV = "QUADS_RL_RUN_DIR"


def step(name: str, ok: bool, detail: str = "") -> None:
    print(f"[rl_gpu] {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def test_tiny_study_on_the_gpu(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (H200 run)")
    missing = missing_for_gpu()
    if missing:
        pytest.skip(f"needs {missing}")
    out = os.environ.get(RUN_DIR_ENV) or str(tmp_path / "run")
    cmd = [sys.executable, "-m", "quads_megatron.cli", "rl", "--out", out, *SMOKE_ARGS, "--budget-s", "420"]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env)
    print(res.stdout[-6000:], res.stderr[-3000:], sep="\n")
    assert res.returncode != EXIT_UNFINISHED, f"unfinished within the budget: rerun with {RUN_DIR_ENV}={out} to resume"
    assert res.returncode == 0, f"quads rl exited with {res.returncode}"
    out = pathlib.Path(out)
    data = json.load(open(out / "summary" / "rl_summary.json"))
    gaps = {}
    for name, arm in data["arms"].items():
        assert arm["done"] and len(arm["rows"]) == 3, name
        for row in arm["rows"]:
            bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
            assert not bad, (name, bad)
        gaps[name] = arm["summary"]["gap_mean"]
    step("every arm finished with finite metrics", True, json.dumps(gaps))
    ok = gaps["bf16"] < 0.2
    step("the BF16 engine's logprobs line up with the trainer's", ok, f"mean |gap| {gaps['bf16']:.4f}")
    assert ok
    ok = gaps["naive"] > gaps["bf16"]
    step("naive NVFP4 drifts above the BF16 floor", ok, f"{gaps['naive']:.4f} vs {gaps['bf16']:.4f}")
    at = data["arms"]["quads"]["attribution"]
    assert at and len(at["layers"]) == 2 and all(math.isfinite(r["gap_only"]) for r in at["layers"])
