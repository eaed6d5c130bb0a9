"""MoE routing in one Triton launch: (token, slot) pairs grouped by expert, as rollout.moe_block.route.

A stable counting sort with one program per expert and one for the foreign pairs (ids outside [0, E),
e.g. -1 from SGLang's expert parallelism, grouped last in slot order). Program e counts the pairs of
experts before e (its first grouped row), then places its own pairs in slot order by a prefix sum over
each chunk. Same outputs, bit for bit, as the torch path (about a dozen small launches), plus what the
block needs next (each row's token, each slot's row) and, if asked, the GEMMs' row-tile table
(row_tiles.tile_map's entries: program e writes its expert's tiles, from a histogram of all keys).
Every program reads all T*k ids twice, so the kernel suits decode-sized batches (ROUTE_MAX_ROWS); above
rollout.moe_block.KERNEL_ROUTING_MAX_ROWS the block takes route_chunked.py's two launches.
route_program also runs as extra programs of the activation quantization's launch (act_quant), so that
routing and fc1's quantization, which do not depend on each other, can take one launch
(rollout.moe_block.routing_path).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quads_megatron.kernels import pdl
from quads_megatron.kernels.pdl import wait_then_release
from quads_megatron.kernels.row_tiles import RowTiles

#: the most (token, slot) pairs this kernel routes (1024 tokens at top-8; the block: moe_block.KERNEL_ROUTING_MAX_ROWS)
ROUTE_MAX_ROWS = 8192
#: ids read per program per step (a whole decode batch in one step up to 256 tokens at top-8)
ROUTE_BLOCK = 2048


@dataclass(frozen=True)
class Routing:
    """order int64 [T*k] (flat slot of each grouped row), offs int32 [E] (cumulative row ends), valid bool
    [T*k] (grouped row of a local expert; int8 while a launch fills it), tokens int64 [T*k] (token of each
    grouped row), pos int64 [T*k] (grouped row of each flat slot: order's inverse; None where not made),
    tiles: the grouped rows' RowTiles where the launch was asked for them."""

    order: torch.Tensor
    offs: torch.Tensor
    valid: torch.Tensor
    tokens: torch.Tensor
    pos: torch.Tensor | None
    tiles: RowTiles | None = None


@triton.jit
def pair_keys(ids_ptr, i, N, E):
    """Sort keys of pairs i: the expert for local ids, E for foreign ones, E + 1 past the last pair."""
    ids = tl.load(ids_ptr + i, mask=i < N, other=-1)
    return tl.where(i < N, tl.where((ids >= 0) & (ids < E), ids, E), E + 1)


@triton.jit
def route_program(
    ids_ptr,
    order_ptr,
    pos_ptr,
    tokens_ptr,
    valid_ptr,
    offs_ptr,
    tmap_ptr,
    N,
    E,
    P,
    e,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    HISTOGRAM: tl.constexpr,
    HAS_TM: tl.constexpr,
    TM_BM: tl.constexpr,
):
    """Program e < E places expert e's pairs; program E the foreign ones (key E: after every local pair).

    NB: a power of two > E + 1 (histogram bins of the keys). HAS_TM: also the row-tile table of TM_BM-row
    tiles (row_tiles.tile_map's entries, P of them): program e writes its expert's tiles, program E the
    empty ones past the last tile."""
    before = tl.zeros((), tl.int32)
    b = tl.arange(0, NB)
    counts = tl.zeros((NB,), tl.int32)  # HAS_TM: pairs per key (for the tile counts)
    for c in range(0, N, BLOCK):  # pass 1: pairs of earlier keys (local experts < e)
        key = pair_keys(ids_ptr, c + tl.arange(0, BLOCK), N, E)
        before += tl.sum((key < e).to(tl.int32), 0)
        if HAS_TM and HISTOGRAM:
            counts += tl.histogram(key.to(tl.int32), NB)
        elif HAS_TM:  # the same counts, one-hot (Triton's interpreter histogram fails: int64 data, int32 type)
            counts += tl.sum((key[:, None] == b[None, :]).to(tl.int32), 0)
    row = before  # next free grouped row of key e
    for c in range(0, N, BLOCK):  # pass 2: this key's pairs in slot order
        i = c + tl.arange(0, BLOCK)
        key = pair_keys(ids_ptr, i, N, E)
        mine = key == e
        one = mine.to(tl.int32)
        p = row + tl.cumsum(one, 0) - one
        tl.store(pos_ptr + i, p.to(tl.int64), mask=mine)
        tl.store(order_ptr + p, i.to(tl.int64), mask=mine)
        tl.store(tokens_ptr + p, (i // TOPK).to(tl.int64), mask=mine)
        tl.store(valid_ptr + p, (key < E).to(tl.int8), mask=mine)
        row += tl.sum(one, 0)
    tl.store(offs_ptr + e, row, mask=e < E)
    if HAS_TM:
        tiles = tl.where(b < E, (counts + TM_BM - 1) // TM_BM, 0)
        first = tl.sum(tl.where(b < e, tiles, 0), 0)  # this expert's first tile
        total = tl.sum(tiles, 0)
        if e < E:
            end = first + (row - before + TM_BM - 1) // TM_BM
        else:  # the foreign program: every tile past the last one
            first, end = total, P
        for t0 in range(first, end, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            live = (t < end) & (e < E)
            tm = (t < end) & (t < P)
            out = tmap_ptr + t * 4
            tl.store(out, tl.where(live, e, -1), mask=tm)
            tl.store(out + 1, tl.where(live, before + (t - first) * TM_BM, 0), mask=tm)
            tl.store(out + 2, tl.where(live, row, 0), mask=tm)
            tl.store(out + 3, tl.zeros_like(t) + total, mask=tm)


@triton.jit
def _route_kernel(
    ids_ptr,
    order_ptr,
    pos_ptr,
    tokens_ptr,
    valid_ptr,
    offs_ptr,
    tmap_ptr,
    N,
    E,
    P,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    HISTOGRAM: tl.constexpr,
    HAS_TM: tl.constexpr,
    TM_BM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    route_program(
        ids_ptr, order_ptr, pos_ptr, tokens_ptr, valid_ptr, offs_ptr, tmap_ptr, N, E, P, tl.program_id(0),
        TOPK, BLOCK, NB, HISTOGRAM, HAS_TM, TM_BM,
    )  # fmt: skip


@dataclass(frozen=True)
class RouteLaunch:
    """A routing launch's checked inputs and its outputs, allocated (shared by route and by act_quant, whose
    launch can route too): ids [T*k] contiguous, the Routing to fill, the row-tile table to fill (None
    without tile_rows) and the kernel's arguments after the pointers."""

    ids: torch.Tensor
    routing: Routing
    tiles: RowTiles | None
    args: tuple
    consts: dict

    @property
    def pointers(self) -> tuple:
        r = self.routing
        table = self.tiles.table if self.tiles is not None else r.offs
        return (self.ids, r.order, r.pos, r.tokens, r.valid, r.offs, table)

    def result(self) -> Routing:
        """The Routing once the launch has run (valid as bool, the row tiles attached)."""
        return dataclasses.replace(self.routing, valid=self.routing.valid.view(torch.bool), tiles=self.tiles)


def integer_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """topk_ids checked as integer [T, k], as int32 or int64 (narrower integers widened)."""
    integer = not (topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool)
    if topk_ids.dim() != 2 or not integer:
        raise ValueError(f"topk ids must be integer [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    return topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.long()


def route_launch(topk_ids: torch.Tensor, num_experts: int, tile_rows: int | None = None) -> RouteLaunch:
    """Check topk_ids [T, k] (integers; ids outside [0, num_experts) are foreign; T*k <= ROUTE_MAX_ROWS) and
    allocate a routing launch's outputs; tile_rows: also the RowTiles of the grouped rows in tiles of that many."""
    topk_ids = integer_ids(topk_ids)
    n = topk_ids.numel()
    if n > ROUTE_MAX_ROWS:
        raise ValueError(f"route kernel: {n} (token, slot) pairs exceed ROUTE_MAX_ROWS={ROUTE_MAX_ROWS}")
    if tile_rows is not None and tile_rows < 1:
        raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
    dev = topk_ids.device
    order = torch.empty(n, dtype=torch.int64, device=dev)
    valid = torch.empty(n, dtype=torch.int8, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    routing = Routing(order, offs, valid, torch.empty_like(order), torch.empty_like(order))
    tiles = None
    if tile_rows is not None:
        table = torch.empty((RowTiles.count(n, tile_rows, num_experts), 4), dtype=torch.int32, device=dev)
        tiles = RowTiles(table, tile_rows, n)
    block = max(16, min(ROUTE_BLOCK, triton.next_power_of_2(n)))
    consts = dict(
        TOPK=topk_ids.shape[1],
        BLOCK=block,
        NB=triton.next_power_of_2(num_experts + 2),
        HISTOGRAM=os.environ.get("TRITON_INTERPRET", "0") != "1",
        HAS_TM=tiles is not None,
        TM_BM=tile_rows or 1,
    )
    p = 0 if tiles is None else tiles.table.shape[0]
    return RouteLaunch(topk_ids.contiguous().reshape(-1), routing, tiles, (n, num_experts, p), consts)


def route_warps(block: int) -> int:
    """Warps of the routing launch for BLOCK ids a step (dev/probe_route_block.py times other steps)."""
    return 4 if block <= 1024 else 8


def route(topk_ids: torch.Tensor, num_experts: int, tile_rows: int | None = None) -> Routing:
    """topk_ids [T, k] (integers; ids outside [0, num_experts) are foreign) -> Routing, in one launch.
    T*k must be <= ROUTE_MAX_ROWS. tile_rows: the same launch also writes the RowTiles of the grouped rows
    in tiles of tile_rows (Routing.tiles)."""
    launch = route_launch(topk_ids, num_experts, tile_rows)
    n, e = launch.args[:2]
    if n:
        _route_kernel[(e + 1,)](
            *launch.pointers,
            *launch.args,
            **launch.consts,
            num_warps=route_warps(launch.consts["BLOCK"]),
            **pdl.launch_options(topk_ids.device),
        )
    else:
        launch.routing.offs.zero_()
        if launch.tiles is not None:
            launch.tiles.table.copy_(torch.tensor([-1, 0, 0, 0], dtype=torch.int32).expand_as(launch.tiles.table))
    return launch.result()
