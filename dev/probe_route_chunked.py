"""Device probe: the chunked routing (kernels/route_chunked.py) by pairs per chunk, against the one-launch
routing kernel (where it fits) and the torch routing, same run, same ids; every output must equal the torch
routing's.

python dev/probe_route_chunked.py [--tokens 1024,4096,16384] [--chunks 256,512,1024]
(CUDA GPU; random top-8 routing over 128 experts; CUDA-graph replay medians in us; the torch routing as
moe_w4a4 runs it: moe_block.route, each row's token and the combine's inverse permutation)
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from quads_megatron.kernels import route
from quads_megatron.kernels.route_chunked import chunk_pairs, route_chunked
from quads_megatron.rollout import moe_block


def torch_routing(ids: torch.Tensor, experts: int) -> tuple:
    """moe_w4a4's torch path: moe_block.route, each row's token and the combine's inverse permutation."""
    order, offs, valid = moe_block.route(ids, experts)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    return order, offs, valid, order // ids.shape[1], pos


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--chunks", default="256,512,1024")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def us(fn) -> float:
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3

    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = torch.randn(tokens, args.experts, generator=g, device="cuda").topk(args.topk, dim=-1).indices
        ids[::7, 0] = -1  # slots of another EP rank
        want = torch_routing(ids, args.experts)
        line = [f"torch {us(lambda: torch_routing(ids, args.experts)):.2f} us"]
        if ids.numel() <= route.ROUTE_MAX_ROWS:
            line.append(f"one launch {us(lambda: route.route(ids, args.experts)):.2f} us")
        for chunk in (int(c) for c in args.chunks.split(",")):
            r = route_chunked(ids, args.experts, chunk)
            got = (r.order, r.offs, r.valid, r.tokens, r.pos)
            same = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
            t = us(lambda: route_chunked(ids, args.experts, chunk))  # noqa: B023
            tag = " (default)" if chunk == chunk_pairs(ids.numel()) else ""
            line.append(f"chunk {chunk}{tag} {t:.2f} us{'' if same else ' OUTPUTS DIFFER'}")
        print(f"tokens {tokens} ({ids.numel()} pairs): " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
