"""Device probe: the routing launch (kernels/route.py) by ids read per step (route.ROUTE_BLOCK), same run,
same ids; every setting's outputs must equal the first one's. Steps longer than 2048 ids run on 16 warps (the
step's prefix sum spread over more threads), the others on the launch's own warps (route.route_warps).

python dev/probe_route_block.py [--tokens 256,512,1024] [--blocks 2048,4096,8192]
(CUDA GPU; random top-8 routing over 128 experts, with the 32-row tile table the block asks for; CUDA-graph
replay medians in us)
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from quads_megatron.kernels import route


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,512,1024")
    ap.add_argument("--blocks", default="2048,4096,8192")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    shipped, shipped_warps = route.ROUTE_BLOCK, route.route_warps

    def warps(block: int) -> int:
        return 16 if block > 2048 else shipped_warps(block)

    route.route_warps = warps
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = torch.randn(tokens, args.experts, generator=g, device="cuda").topk(args.topk, dim=-1).indices
        line, first = [], None
        for block in (int(b) for b in args.blocks.split(",")):
            route.ROUTE_BLOCK = block
            got = route.route(ids, args.experts, tile_rows=32)
            outs = [got.order, got.offs, got.valid, got.tokens, got.pos, got.tiles.table]
            if first is None:
                first = outs
            same = all(torch.equal(a, b) for a, b in zip(first, outs, strict=True))
            us = triton.testing.do_bench_cudagraph(
                lambda: route.route(ids, args.experts, tile_rows=32), rep=30, return_mode="median"
            )
            line.append(
                f"block {block} ({route.route_warps(min(block, tokens * args.topk))} warps) {us * 1e3:.2f} us"
                f"{'' if same else ' OUTPUTS DIFFER'}"
            )
        print(f"tokens {tokens} ({tokens * args.topk} ids): " + "; ".join(line), flush=True)
    route.ROUTE_BLOCK, route.route_warps = shipped, shipped_warps


if __name__ == "__main__":
    main()
