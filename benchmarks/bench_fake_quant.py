"""Step time of a real megatron-core MoE layer with and without QUADS fake-quant, and the QDQ cost
per weight version (one QDQ after each optimizer step, reused by every micro-batch).

    python benchmarks/bench_fake_quant.py [--out DIR]      (CPU; writes bench_fake_quant.md)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import torch

import quads_megatron
from quads_megatron import fake_quant
from quads_megatron.demo.cpu_megatron import (
    build_moe_layer,
    init_distributed,
    install_cpu_shims_for_megatron,
    moe_config,
)


def step_time(layer, x, micro_batches: int, steps: int) -> float:
    opt = torch.optim.SGD(layer.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        for _ in range(micro_batches):
            out, _ = layer(x)
            out.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]  # median, first step (warm-up) dropped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    install_cpu_shims_for_megatron()
    init_distributed()
    torch.manual_seed(0)
    cfg = dict(num_experts=a.experts, hidden=a.hidden, ffn=a.ffn, topk=2)
    x = torch.randn(a.tokens, 1, a.hidden)
    rows = []
    for cache in (True, False):
        plain = build_moe_layer(moe_config(**cfg), seed=0)
        t_plain = step_time(plain, x, a.micro_batches, a.steps)
        quads_megatron.apply({"trainer": {"cache_qdq": cache}})
        layer = build_moe_layer(moe_config(**cfg), seed=0)
        fake_quant.reset_stats()
        t_fq = step_time(layer, x, a.micro_batches, a.steps)
        qdq_per_step = fake_quant.STATS.qdq_seconds / (a.steps + 1)
        calls_per_step = fake_quant.STATS.qdq_calls / (a.steps + 1)
        quads_megatron.remove()
        rows.append((cache, t_plain, t_fq, qdq_per_step, calls_per_step))
    weights = 2 * a.experts
    lines = [
        f"# Fake-quant overhead ({datetime.date.today().isoformat()}, "
        f"CPU: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__})",
        "",
        f"megatron-core MoELayer (SequentialMLP), {a.experts} experts, hidden {a.hidden}, ffn {a.ffn}, top-2, "
        f"{a.tokens} tokens x {a.micro_batches} micro-batches per optimizer step; median of {a.steps} steps.",
        "",
        "| QDQ cache | unpatched step s | QUADS step s | overhead | QDQ s per step | QDQ calls per step |",
        "|---|---|---|---|---|---|",
    ]
    for cache, tp, tf, q, c in rows:
        lines.append(
            f"| {'on' if cache else 'off'} | {tp:.3f} | {tf:.3f} | {100 * (tf / tp - 1):.1f}% | {q:.4f} | {c:.0f} |"
        )
    lines += [
        "",
        f"{weights} expert weights: with the cache one QDQ per weight per step, without it one per micro-batch.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_fake_quant.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
