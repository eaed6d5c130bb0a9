"""MoE routing in one Triton launch: (token, slot) pairs grouped by expert, as rollout.moe_block.route.

A stable counting sort in one program: pass 1 counts rows per expert, pass 2 places each pair at its
expert's start plus the number of earlier pairs of that expert. Pairs of foreign experts (ids outside
[0, E), e.g. -1 from SGLang's expert parallelism) go last, in slot order. Same outputs, bit for bit, as
the torch path (about a dozen small launches), plus what the block needs next (each row's token, each
slot's row): one launch at decode, where the launches are the cost. The one program walks the pairs in
chunks, so it suits decode-sized batches (ROUTE_MAX_ROWS); prefill keeps the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quads_megatron.kernels import pdl
from quads_megatron.kernels.pdl import wait_then_release

#: the most (token, slot) pairs routed by the one-program kernel (above: the torch sort)
ROUTE_MAX_ROWS = 4096


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
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    experts = tl.arange(0, BLOCK_E)
    hist = tl.zeros((BLOCK_E,), tl.int32)
    for c in range(0, N, BLOCK):  # pass 1: rows per expert
        i = c + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + i, mask=i < N, other=-1)
        e = tl.where(e < E, e, -1)  # foreign ids beyond E must not meet the padding experts
        hist += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    ends = tl.cumsum(hist, 0)
    tl.store(offs_ptr + experts, ends, mask=experts < E)
    base = ends - hist  # next free row of each expert
    foreign_base = tl.sum(hist, 0)  # foreign pairs after every local one
    for c in range(0, N, BLOCK):  # pass 2: place each pair
        i = c + tl.arange(0, BLOCK)
        m = i < N
        e = tl.load(ids_ptr + i, mask=m, other=-1)
        e = tl.where(e < E, e, -1)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)  # all zero for foreign or masked pairs
        earlier = tl.cumsum(onehot, 0) - onehot  # earlier pairs of the same expert in this chunk
        local = e >= 0
        foreign = (m & ~local).to(tl.int32)
        p_local = tl.sum(onehot * (base[None, :] + earlier), 1)
        p = tl.where(local, p_local, foreign_base + tl.cumsum(foreign, 0) - foreign)
        tl.store(pos_ptr + i, p.to(tl.int64), mask=m)
        tl.store(order_ptr + p, i.to(tl.int64), mask=m)
        tl.store(tokens_ptr + p, (i // TOPK).to(tl.int64), mask=m)
        tl.store(valid_ptr + p, local.to(tl.int8), mask=m)
        base += tl.sum(onehot, 0)
        foreign_base += tl.sum(foreign, 0)


def route(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    """topk_ids [T, k] (integers; ids outside [0, num_experts) are foreign) -> Routing, in one launch.
    T*k must be <= ROUTE_MAX_ROWS (the one-program kernel's range)."""
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
    block_e = triton.next_power_of_2(max(num_experts, 2))
    block = max(16, min(128, triton.next_power_of_2(n), 16384 // block_e))  # the one-hot chunk: <= 16K values
    if n:
        _route_kernel[(1,)](
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
            BLOCK_E=block_e,
            num_warps=4,
            **pdl.launch_options(dev),
        )
    else:
        offs.zero_()
    return Routing(order, offs, valid.view(torch.bool), tokens, pos)
