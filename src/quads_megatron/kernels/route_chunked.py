"""MoE routing of any number of (token, slot) pairs in two Triton launches (kernels/route.py's Routing).

A stable counting sort by chunks of CHUNK pairs, for the prefill sizes where route.py's one launch (every
program reads all ids: O(E * N)) does not fit. Launch 1 counts each chunk's keys (the expert; E for
foreign ids, grouped last). Launch 2 gives each chunk its first grouped row per key (the pairs of earlier
keys, plus the earlier chunks' pairs of the same key, from all chunks' counts), sorts the chunk's pairs
by (key, slot) and places them: O(N) work and O(C^2 * NB) count reads from L2. Same bits as the torch
path (rollout.moe_block.route) and as route.py, with order's inverse (pos) for the combine. The block's
routing above moe_block.KERNEL_ROUTING_MAX_ROWS pairs (H200 2026-12-07: 4.5 us at 4096 pairs, 8.5 at 32768,
18.2 at 131072; the torch ops 65 / 102 / 137 us).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quads_megatron.kernels import pdl
from quads_megatron.kernels.pdl import wait_then_release
from quads_megatron.kernels.route import Routing, integer_ids, pair_keys

#: chunks a launch aims for (one program each); a chunk holds between CHUNK_MIN and CHUNK_MAX pairs
CHUNK_TARGET = 128
CHUNK_MIN = 256
CHUNK_MAX = 4096


@triton.jit
def _chunk_counts_kernel(
    ids_ptr, counts_ptr, N, E, CHUNK: tl.constexpr, NB: tl.constexpr, HISTOGRAM: tl.constexpr, PDL: tl.constexpr
):
    """counts[c, b]: pairs of key b in chunk c (int32 [C, NB]; key E + 1 counts the padding past N)."""
    wait_then_release(PDL)
    c = tl.program_id(0)
    key = pair_keys(ids_ptr, c * CHUNK + tl.arange(0, CHUNK), N, E).to(tl.int32)
    b = tl.arange(0, NB)
    if HISTOGRAM:
        counts = tl.histogram(key, NB)
    else:  # the same counts, one-hot (Triton's interpreter histogram fails: int64 data, int32 type)
        counts = tl.sum((key[:, None] == b[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + c * NB + b, counts)


@triton.jit
def _chunk_place_kernel(
    ids_ptr,
    counts_ptr,
    order_ptr,
    pos_ptr,
    tokens_ptr,
    valid_ptr,
    offs_ptr,
    N,
    E,
    C,
    TOPK: tl.constexpr,
    CHUNK: tl.constexpr,
    NB: tl.constexpr,
    CB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Chunk c's pairs to their grouped rows (order, pos, tokens, valid); chunk 0 also writes offs.
    CB: count rows read per step."""
    wait_then_release(PDL)
    c = tl.program_id(0)
    b = tl.arange(0, NB)
    total = tl.zeros((NB,), tl.int32)  # pairs per key, all chunks
    earlier = tl.zeros((NB,), tl.int32)  # pairs per key in chunks before c
    for c0 in range(0, C, CB):
        r = c0 + tl.arange(0, CB)
        tile = tl.load(counts_ptr + r[:, None] * NB + b[None, :], mask=(r < C)[:, None], other=0)
        total += tl.sum(tile, 0)
        earlier += tl.sum(tl.where((r < c)[:, None], tile, 0), 0)
    ends = tl.cumsum(total, 0)  # grouped row end of each key (keys in order: local experts, foreign, padding)
    own = tl.load(counts_ptr + c * NB + b)
    # grouped row of the chunk's pair of key b at sorted position s is s + base[b]
    base = ends - total + earlier - (tl.cumsum(own, 0) - own)
    s = tl.arange(0, CHUNK)
    key = pair_keys(ids_ptr, c * CHUNK + s, N, E).to(tl.int32)
    packed = tl.sort(key * CHUNK + s)  # (key, slot) order: stable within the chunk
    k_s = packed // CHUNK
    slot = (c * CHUNK + packed % CHUNK).to(tl.int64)
    row = tl.gather(base, k_s, 0) + s
    live = k_s <= E
    tl.store(order_ptr + row, slot, mask=live)
    tl.store(pos_ptr + slot, row.to(tl.int64), mask=live)
    tl.store(tokens_ptr + row, slot // TOPK, mask=live)
    tl.store(valid_ptr + row, (k_s < E).to(tl.int8), mask=live)
    tl.store(offs_ptr + b, ends, mask=(b < E) & (c == 0))


def chunk_pairs(n: int) -> int:
    """Pairs per chunk for n pairs: a power of two near n / CHUNK_TARGET, within [CHUNK_MIN, CHUNK_MAX]."""
    return max(CHUNK_MIN, min(CHUNK_MAX, triton.next_power_of_2(triton.cdiv(max(n, 1), CHUNK_TARGET))))


def key_bins(experts: int) -> int:
    """Histogram bins of the keys: a power of two > E + 1 (local experts, the foreign key E, the padding E + 1)."""
    return triton.next_power_of_2(experts + 2)


def count_rows_per_step(chunks: int, bins: int) -> int:
    """Rows of the counts the placing launch reads per step (CB): at most 8192 counts in registers."""
    return max(1, min(triton.next_power_of_2(chunks), 8192 // bins))


def chunk_warps(chunk: int) -> int:
    """Warps of both launches for chunks of this many pairs."""
    return 4 if chunk <= 1024 else 8


def route_chunked(topk_ids: torch.Tensor, num_experts: int, chunk: int | None = None) -> Routing:
    """topk_ids [T, k] (integers; ids outside [0, num_experts) are foreign) -> Routing (pos made, no row
    tiles), in two launches, for any T*k. chunk: pairs per chunk (a power of two; None: chunk_pairs)."""
    topk_ids = integer_ids(topk_ids)
    n, e = topk_ids.numel(), num_experts
    chunk = chunk_pairs(n) if chunk is None else chunk
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    dev = topk_ids.device
    order = torch.empty(n, dtype=torch.int64, device=dev)
    valid = torch.empty(n, dtype=torch.int8, device=dev)
    offs = torch.empty(e, dtype=torch.int32, device=dev)
    tokens, pos = torch.empty_like(order), torch.empty_like(order)
    if n == 0:
        offs.zero_()
        return Routing(order, offs, valid.view(torch.bool), tokens, pos)
    nb = key_bins(e)
    c = triton.cdiv(n, chunk)
    counts = torch.empty((c, nb), dtype=torch.int32, device=dev)
    ids = topk_ids.contiguous().reshape(-1)
    opts = dict(num_warps=chunk_warps(chunk), **pdl.launch_options(dev))
    histogram = os.environ.get("TRITON_INTERPRET", "0") != "1"
    _chunk_counts_kernel[(c,)](ids, counts, n, e, CHUNK=chunk, NB=nb, HISTOGRAM=histogram, **opts)
    cb = count_rows_per_step(c, nb)
    _chunk_place_kernel[(c,)](
        ids, counts, order, pos, tokens, valid, offs, n, e, c,
        TOPK=topk_ids.shape[1], CHUNK=chunk, NB=nb, CB=cb, **opts,
    )  # fmt: skip
    return Routing(order, offs, valid.view(torch.bool), tokens, pos)
