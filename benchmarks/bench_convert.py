"""Converter throughput: a synthetic HF MoE checkpoint (BF16, Qwen3-MoE names, several shards)
converted to NVFP4 ModelOpt layout, with and without --verify.

    python benchmarks/bench_convert.py [--out DIR]     (CPU; writes bench_convert.md)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time

import torch
from safetensors.torch import save_file

from quads_megatron.checkpoint import INDEX, ConvertOptions, convert_hf


def make_checkpoint(path: str, layers: int, experts: int, hidden: int, inter: int) -> int:
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for layer in range(layers):
        shard = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        sd = {f"model.layers.{layer}.mlp.gate.weight": torch.randn(experts, hidden, generator=g).bfloat16()}
        for e in range(experts):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            sd[f"{p}.gate_proj.weight"] = (torch.randn(inter, hidden, generator=g) * 0.02).bfloat16()
            sd[f"{p}.up_proj.weight"] = (torch.randn(inter, hidden, generator=g) * 0.02).bfloat16()
            sd[f"{p}.down_proj.weight"] = (torch.randn(hidden, inter, generator=g) * 0.02).bfloat16()
        save_file(sd, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in sd})
        total += sum(t.numel() * 2 for t in sd.values())
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=768)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "hf")
        nbytes = make_checkpoint(src, a.layers, a.experts, a.hidden, a.inter)
        for verify in (False, True):
            dst = os.path.join(tmp, f"out{int(verify)}")
            t0 = time.perf_counter()
            convert_hf(src, dst, ConvertOptions(verify=verify, progress=False))
            rows.append((verify, time.perf_counter() - t0))
    lines = [
        f"# Converter throughput ({datetime.date.today().isoformat()}, CPU: {platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__})",
        "",
        f"Synthetic BF16 checkpoint: {a.layers} layers x {a.experts} experts, hidden {a.hidden}, moe inter {a.inter} "
        f"({nbytes / 1e6:.0f} MB, one shard per layer).",
        "",
        "| mode | seconds | MB/s (BF16 in) |",
        "|---|---|---|",
    ] + [f"| {'convert + verify' if v else 'convert'} | {s:.2f} | {nbytes / 1e6 / s:.0f} |" for v, s in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_convert.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
