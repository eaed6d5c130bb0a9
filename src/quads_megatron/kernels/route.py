"""MoE routing in one Triton launch: (token, slot) pairs grouped by expert, as rollout.moe_block.route.

A stable counting sort with one program per expert and one for the foreign pairs (ids outside [0, E),
e.g. -1 from SGLang's expert parallelism, grouped last in slot order). Program e counts the pairs of
experts before e (its first grouped row), then places its own pairs in slot order by a prefix sum over
each chunk. Same outputs, bit for bit, as the torch path (about a dozen small launches), plus what the
block needs next (each row's token, each slot's row). Every program reads all T*k ids twice, so the
kernel suits decode-sized batches (ROUTE_MAX_ROWS); above that the torch sort is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quads_megatron.kernels import pdl
from quads_megatron.kernels.pdl import wait_then_release

#: the most (token, slot) pairs routed by this kernel (above: the torch sort); 1024 tokens at top-8
ROUTE_MAX_ROWS = 8192
#: ids read per program per step (a whole decode batch in one step up to 256 tokens at top-8)
ROUTE_BLOCK = 2048


@dataclass(frozen=True)
class Routing:
    """order int64 [T*k] (flat slot of each grouped row), offs int32 [E] (cumulative row ends), valid bool
    [T*k] (grouped row of a local expert), tokens int64 [T*k] (token of each grouped row), pos int64
    [T*k] (grouped row of each flat slot: order's inverse)."""

    order: torch.Tensor
    offs: torch.Tensor
    valid: torch.Tensor
    tokens: torch.Tensor
    pos: torch.Tensor


@triton.jit
def _keys(ids_ptr, i, N, E):
    """Sort keys of pairs i: the expert for local ids, E for foreign ones, E + 1 past the last pair."""
    ids = tl.load(ids_ptr + i, mask=i < N, other=-1)
    return tl.where(i < N, tl.where((ids >= 0) & (ids < E), ids, E), E + 1)


@triton.jit
def _route_kernel(
    ids_ptr,
    order_ptr,
    pos_ptr,
    tokens_ptr,
    valid_ptr,
    offs_ptr,
    N,
    E,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program e < E places expert e's pairs; program E the foreign ones (key E: after every local pair)."""
    wait_then_release(PDL)
    e = tl.program_id(0)
    before = tl.zeros((), tl.int32)
    for c in range(0, N, BLOCK):  # pass 1: pairs of earlier keys (local experts < e)
        i = c + tl.arange(0, BLOCK)
        before += tl.sum((_keys(ids_ptr, i, N, E) < e).to(tl.int32), 0)
    row = before  # next free grouped row of key e
    for c in range(0, N, BLOCK):  # pass 2: this key's pairs in slot order
        i = c + tl.arange(0, BLOCK)
        key = _keys(ids_ptr, i, N, E)
        mine = key == e
        one = mine.to(tl.int32)
        p = row + tl.cumsum(one, 0) - one
        tl.store(pos_ptr + i, p.to(tl.int64), mask=mine)
        tl.store(order_ptr + p, i.to(tl.int64), mask=mine)
        tl.store(tokens_ptr + p, (i // TOPK).to(tl.int64), mask=mine)
        tl.store(valid_ptr + p, (key < E).to(tl.int8), mask=mine)
        row += tl.sum(one, 0)
    tl.store(offs_ptr + e, row, mask=e < E)


def route(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    """topk_ids [T, k] (integers; ids outside [0, num_experts) are foreign) -> Routing, in one launch.
    T*k must be <= ROUTE_MAX_ROWS."""
    integer = not (topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool)
    if topk_ids.dim() != 2 or not integer:
        raise ValueError(f"topk ids must be integer [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        topk_ids = topk_ids.long()
    n = topk_ids.numel()
    if n > ROUTE_MAX_ROWS:
        raise ValueError(f"route kernel: {n} (token, slot) pairs exceed ROUTE_MAX_ROWS={ROUTE_MAX_ROWS}")
    dev = topk_ids.device
    order = torch.empty(n, dtype=torch.int64, device=dev)
    pos = torch.empty_like(order)
    tokens = torch.empty_like(order)
    valid = torch.empty(n, dtype=torch.int8, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block = max(16, min(ROUTE_BLOCK, triton.next_power_of_2(n)))
    if n:
        _route_kernel[(num_experts + 1,)](
            topk_ids.contiguous(),
            order,
            pos,
            tokens,
            valid,
            offs,
            n,
            num_experts,
            TOPK=topk_ids.shape[1],
            BLOCK=block,
            num_warps=4 if block <= 1024 else 8,
            **pdl.launch_options(dev),
        )
    else:
        offs.zero_()
    return Routing(order, offs, valid.view(torch.bool), tokens, pos)
