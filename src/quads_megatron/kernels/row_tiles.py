"""Row tiles of a grouped GEMM, scheduled on the device (no host sync).

The grouped rows of E experts are given by offs (int32 [E], cumulative row ends, as torch._grouped_mm).
A row-tile table holds per tile (expert, first grouped row, the expert's row end, total tiles), so
every CTA of a GEMM finds its tile in one round trip instead of a binary search over the experts
(a chain of ~8 dependent loads at every CTA's start). The table is built by one small launch
(tile_map), or by extra programs of the activation quantization's launch (act_quant), and shared by
the GEMMs over the same rows (an MoE block's fc1 and fc2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quads_megatron.kernels import pdl
from quads_megatron.kernels.pdl import wait_then_release


@triton.jit
def tile_map_chunk(offs_ptr, map_ptr, E, P, chunk, BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """map[p] = (expert e, first grouped row, e's row end, total tiles) of the row tiles p < P in chunk
    [chunk * BLOCK_P, (chunk + 1) * BLOCK_P); e = -1 (rows 0) past the last tile. Each chunk re-derives
    the per-expert tile counts."""
    e = tl.arange(0, BLOCK_E)
    end = tl.load(offs_ptr + e, mask=e < E, other=0)
    begin = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    count = (end - begin + BM - 1) // BM
    through = tl.cumsum(count, axis=0)  # tiles of experts <= e
    total = tl.max(through, axis=0)
    p = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
    done = (through[None, :] <= p[:, None]) & (e < E)[None, :]  # experts whose tiles all come before p
    pe = tl.sum(done.to(tl.int32), axis=1)  # p's expert: how many experts end at or before it
    before = tl.sum(tl.where(done, count[None, :], 0), axis=1)  # tiles of the experts before pe
    live = p < total
    pe_end = tl.load(offs_ptr + pe, mask=live, other=0)
    pe_begin = tl.load(offs_ptr + pe - 1, mask=live & (pe > 0), other=0)
    row = p * 4
    tl.store(map_ptr + row, tl.where(live, pe, -1), mask=p < P)
    tl.store(map_ptr + row + 1, tl.where(live, pe_begin + (p - before) * BM, 0), mask=p < P)
    tl.store(map_ptr + row + 2, pe_end, mask=p < P)
    tl.store(map_ptr + row + 3, tl.zeros_like(p) + total, mask=p < P)


@triton.jit
def _tile_map_kernel(
    offs_ptr, map_ptr, E, P, BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr
):
    wait_then_release(PDL)
    tile_map_chunk(offs_ptr, map_ptr, E, P, tl.program_id(0), BM, BLOCK_E, BLOCK_P)


def tile_map(offs: torch.Tensor, block_m: int, tiles: int) -> torch.Tensor:
    """int32 [tiles, 4]: per row tile p (grouped rows of offs, int32 [E] cumulative row ends, in tiles of
    block_m), (expert, first grouped row, the expert's row end, total row tiles); expert -1 past the last
    tile. One launch."""
    e = offs.numel()
    out = torch.empty((tiles, 4), dtype=torch.int32, device=offs.device)
    block_p = 128
    _tile_map_kernel[(triton.cdiv(tiles, block_p),)](
        offs, out, e, tiles, BM=block_m, BLOCK_E=triton.next_power_of_2(max(e, 2)), BLOCK_P=block_p,
        **pdl.launch_options(offs.device),
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class RowTiles:
    """A grouped GEMM's row tiles: table int32 [cdiv(rows, block_rows) + E, 4] from tile_map (expert,
    first grouped row, row end, total tiles per tile) for the rows grouped rows of offs in tiles of
    block_rows. Made once and handed to the GEMMs that share offs, rows and block_rows (an MoE block's
    fc1 and fc2), or by the activation quantization's launch (activation_operand(row_tiles=...)): no
    launch of its own."""

    table: torch.Tensor
    block_rows: int
    rows: int

    @staticmethod
    def count(rows: int, block_rows: int, experts: int) -> int:
        """Row tiles to cover rows grouped rows of experts experts (an upper bound: one partial tile each)."""
        return triton.cdiv(rows, block_rows) + experts

    def check(self, rows: int, block_rows: int, experts: int) -> None:
        """Refuse a table made for other tiles, another number of grouped rows or of experts."""
        want = (self.count(rows, block_rows, experts), 4)
        if (self.block_rows, self.rows) != (block_rows, rows) or tuple(self.table.shape) != want:
            raise ValueError(
                f"row tiles of {self.block_rows} rows over {self.rows} grouped rows (table "
                f"{tuple(self.table.shape)}): the GEMM runs {block_rows}-row tiles over {rows} grouped rows "
                f"of {experts} experts"
            )


def row_tiles(offs: torch.Tensor, block_rows: int, rows: int) -> RowTiles:
    """RowTiles of the grouped rows of offs (int32 [E] on the device, rows in all) in one launch."""
    return RowTiles(tile_map(offs, block_rows, RowTiles.count(rows, block_rows, offs.numel())), block_rows, rows)


def gemm_row_tiles(tiles: RowTiles | None, offs: torch.Tensor, block_rows: int, rows: int) -> RowTiles:
    """A grouped GEMM's row tiles: those made beforehand, checked against the GEMM's (RowTiles.check),
    or, where none were given, made here in one launch (row_tiles)."""
    if tiles is None:
        return row_tiles(offs, block_rows, rows)
    tiles.check(rows, block_rows, offs.numel())
    return tiles


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemm_ctas(tiles_bound: int, device: torch.device, ctas_per_sm: int) -> int:
    """CTAs a grouped GEMM launches over at most tiles_bound tiles (their number is known on the device only):
    one per tile, or (ctas_per_sm > 0) persistent ones, at most SMs * ctas_per_sm, looping over the tiles."""
    return min(tiles_bound, _sm_count(device) * ctas_per_sm) if ctas_per_sm else tiles_bound


def grouped_rows(
    m: int, offs: torch.Tensor, a_rows: torch.Tensor | None, e_count: int, device: torch.device
) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """Checked grouped-row inputs of a grouped GEMM over an operand of m rows: (rows, offs int32 [E]
    on device, a_rows contiguous on device or None). rows = a_rows.numel() when given, else m."""
    if a_rows is not None:
        if a_rows.dim() != 1 or a_rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"a_rows must be int32/int64 [rows], got {a_rows.dtype} {tuple(a_rows.shape)}")
        m = a_rows.numel()
        a_rows = a_rows.to(device).contiguous()
    if offs.numel() != e_count:
        raise ValueError(f"offs has {offs.numel()} entries for {e_count} experts")
    return m, offs.to(device=device, dtype=torch.int32), a_rows
