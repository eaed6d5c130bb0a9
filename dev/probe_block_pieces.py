"""Device probe: where the MoE block's time goes, launch by launch.

python dev/probe_block_pieces.py [--tokens 16,64,256] [--rac none,dyn50] [--layout tiled|row_major] [--out DIR]
(CUDA GPU; CUDA-graph replay medians; Qwen3-30B-A3B experts, bench_moe_block's inputs, the weights in the
layout the SGLang method serves unless --layout row_major)
python dev/probe_block_pieces.py --dry-run      (CPU, TRITON_INTERPRET=1: tiny shapes, the pieces' outputs
                                                 checked against the whole block, no timing)

moe_w4a4(impl='auto') is a chain of launches: routing, fc1's activation quantization (with the row-tile
programs), fc1, fc2's gated quantization, fc2 and the top-k combine; by moe_block.routing_path the routing
runs as extra programs of fc1's quantization launch (route_fc1_quant), in its own launch (route), in the
chunked routing's two (route_chunked) or as torch ops (route_torch, with the combine's inverse
permutation). Each is captured and timed alone on the inputs the chain gives it, next to the whole block:
the pieces' sum minus the block is what the chain overlaps (PDL) or adds (launch gaps). The pieces mirror
rollout.moe_block._experts_triton; the check that their output equals the block's, bit for bit, keeps
them in step with it. The routing paths the block does not take are timed too, outside the sum (their
A/B); every path's routing is checked to be the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_moe_block as bmb  # noqa: E402
from probe_route_chunked import torch_routing  # noqa: E402

from quads_megatron.kernels import combine as combine_kernel  # noqa: E402
from quads_megatron.kernels import route  # noqa: E402
from quads_megatron.kernels.route_chunked import route_chunked  # noqa: E402
from quads_megatron.rollout import moe_block as moe  # noqa: E402

#: the block's first launch(es) by moe.routing_path()
FIRST = {
    "fused": ("route_fc1_quant",),
    "kernel": ("route", "fc1_quant"),
    "chunked": ("route_chunked", "fc1_quant"),
    "torch": ("route_torch", "fc1_quant"),
}
PIECES = ("fc1", "fc2_quant", "fc2", "combine")  # after the first launch(es)


def pieces(t: dict, weights: moe.ExpertWeights, rac: moe.LayerRAC) -> dict:
    """The block's launches as closures over the previous launches' outputs (computed once here)."""
    x, ids, w = t["x"], t["ids"], t["w"]
    rows = ids.numel()
    gemm = moe.gemm_impl(x.device, weights, rows) if x.is_cuda else "triton"
    order_kind = "wgmma" if gemm == "wgmma" else "pairs"
    h, i = weights.hidden, weights.intermediate
    cfg1, bt1 = moe._gemm_config(rows, 2 * i, h, gemm, x.dtype, x.device)
    cfg2, bt2 = moe._gemm_config(rows, h, i, gemm, x.dtype, x.device)
    one_launch = rows <= route.ROUTE_MAX_ROWS  # the routing kernel and the fused routing route this many
    r = route.route(ids, weights.num_experts) if one_launch else route_chunked(ids, weights.num_experts)

    def op1():  # as moe_w4a4 runs it at decode sizes: routing by extra programs of this launch
        route_args = (ids, weights.num_experts, bt1)
        return moe._gemm_operand(x, rac.fc1, None, order_kind, None, check=False, route=route_args)

    def op1_alone():
        return moe._gemm_operand(x, rac.fc1, None, order_kind, None, check=False, row_tiles=(r.offs, bt1, rows))

    a1 = op1() if moe.routing_path(rows) == "fused" else op1_alone()
    if one_launch:  # the chunked routing routes as the routing kernel does
        chunked = route_chunked(ids, weights.num_experts)
        for name in ("order", "offs", "valid", "tokens", "pos"):
            assert torch.equal(getattr(chunked, name), getattr(r, name)), name
    if a1.routing is not None:  # the fused launch routes as the routing kernel does
        for name in ("order", "offs", "valid", "tokens", "pos"):
            assert torch.equal(getattr(a1.routing, name), getattr(r, name)), name
    w13 = (weights.w13_codes, weights.w13_scales, weights.w13_sdec)
    w2 = (weights.w2_codes, weights.w2_scales, weights.w2_sdec)

    def fc1():
        return moe._expert_gemm(a1, r.offs, *w13, x.dtype, cfg1, a_rows=r.tokens, tiles=a1.tiles)

    y1 = fc1()
    tiles2 = None if bt2 == bt1 else (r.offs, bt2, rows)

    def op2():
        return moe._gemm_operand(
            y1, rac.fc2, None, order_kind, None, check=False, gated=True, row_valid=r.valid, row_tiles=tiles2
        )

    a2 = op2()

    def fc2():
        return moe._expert_gemm(a2, r.offs, *w2, x.dtype, cfg2, tiles=a1.tiles if bt2 == bt1 else a2.tiles)

    y2 = fc2()

    def comb():
        return combine_kernel.combine(y2, r.order, ids, w, weights.num_experts, x.dtype, r.pos)

    one = {"route_fc1_quant": op1, "route": lambda: route.route(ids, weights.num_experts)} if one_launch else {}
    return {
        **one,
        "route_chunked": lambda: route_chunked(ids, weights.num_experts),
        "route_torch": lambda: torch_routing(ids, weights.num_experts),
        "fc1_quant": op1_alone,
        "fc1": fc1,
        "fc2_quant": op2,
        "fc2": fc2,
        "combine": comb,
        "_out": comb(),
        "_impl": gemm,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,64,256")
    ap.add_argument("--rac", default="none,dyn50", help="comma-separated: none, dyn50 (dynamic RAC 50%%)")
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--layout", choices=("tiled", "row_major"), default="tiled", help="the expert weights' layout")
    ap.add_argument("--out", default=None, help="also write block_pieces.json here")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print("probe_block_pieces: needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    shape = bmb.SHAPE if cuda else bmb.TINY
    tokens = [int(v) for v in args.tokens.split(",")] if cuda else [4, 16]
    inp = bmb.make_inputs(shape, device, tiled=args.layout == "tiled")
    weights = inp["nvfp4"]
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "layout": args.layout,
        "rows": [],
    }
    for n in tokens:
        t = bmb.make_tokens(n, shape, inp, device)
        for mode in args.rac.split(","):
            rac = moe.LayerRAC() if mode == "none" else bmb.rac(shape, t["x"], False, device)
            p = pieces(t, weights, rac)
            whole = moe.moe_w4a4(t["x"], t["ids"], t["w"], weights, rac, impl="auto" if cuda else "triton", check=False)
            same = torch.equal(p["_out"], whole)
            row = {"tokens": n, "rac": mode, "impl": p["_impl"], "pieces_equal_block": same}
            if cuda:
                fn = lambda: moe.moe_w4a4(t["x"], t["ids"], t["w"], weights, rac, impl="auto", check=False)  # noqa: E731
                row["block_us"] = bmb.time_us(fn, True, args.rep_ms)
                for name in PIECES:
                    row[f"{name}_us"] = bmb.time_us(p[name], True, args.rep_ms)
                path = moe.routing_path(t["ids"].numel())
                for name in dict.fromkeys(sum(FIRST.values(), ())):
                    if name in p:
                        row[f"{name}_us"] = bmb.time_us(p[name], True, args.rep_ms)
                row["routing"] = path
                row["sum_us"] = sum(row[f"{k}_us"] for k in FIRST[path] + PIECES)
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "block_pieces.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(r["pieces_equal_block"] for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
