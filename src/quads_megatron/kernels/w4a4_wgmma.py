"""Hopper (sm_90) grouped W4A4 GEMM in Gluon: FP4 weights decoded straight into wgmma's register operand.

The product is computed transposed, y^T[n, row] = W_e[n, :] . A[row, :], so the decoded weights are
wgmma's A operand, which may live in registers: no shared-memory round trip for them, and the token
rows (few per expert at decode sizes) are wgmma's N, which can be as small as 8. Each warpgroup owns
64 weight rows; a k-step covers 128 elements (64 code bytes per row, 16 per thread).

Operand order ("wgmma"): each thread loads 16 contiguous code bytes of a row and its decoded values
must land in the registers wgmma reads for its lane. That fixes a permutation of K inside every
128-element chunk (``operand_permutation``); the activation operand (activation_operand(order=
"wgmma")) is written in that permuted order, so the GEMM only copies its rows. The sums are the
same dot products, each accumulated in fp32 in another order than the Triton kernel's.

Pipeline: activation rows (gathered through a_rows), code bytes and scale bytes of a k-step arrive
by cp.async in a STAGES-deep ring. The K loop runs in straight-line runs of UNROLL k-steps: inside a
run each chunk's decode overlaps the previous chunk's wgmma (wait(1)); the run ends with wait(0). A
wgmma left in flight across the loop's back edge had ptxas reuse its register operand (corrupted
tiles on the H200); inside straight-line code ptxas keeps it. sass_hazards checks exactly that on
each compiled kernel (grouped_w4a4_wgmma falls back to 1-step runs where it finds a hazard).

Warp-specialized variant (_w4a4_wgmma_ws_kernel, wgmma_config's choice above 1024 grouped rows): a
loader partition (cp.async, per-slot mbarriers; one or two 128-K chunks per slot) fills the ring, the
consumer warps only wait, decode, wgmma and free the slot (one partition, or one per consumer
warpgroup: "split consumers"); with ctas_per_sm its CTAs persist and loop over the tiles. Every CTA
finds its tile (expert, rows) in a row-tile table (w4a4_grouped.RowTiles): one round trip, where a
binary search over the experts took ~8 dependent loads. The table comes from the activation
quantization's launch (moe_w4a4: one table for fc1 and fc2) or from a small launch of its own. Both
kernels wait for the previous kernel before their first read and may be launched programmatically
dependent (kernels/pdl.py). On the H200 the load path, not the decode or the MMA, is what most of its
time goes to (benchmarks/NOTES.md).
"""

from __future__ import annotations

import functools
import subprocess
import warnings

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quads_megatron.kernels import pdl
from quads_megatron.kernels.sass_hazards import disassemble, wgmma_register_hazards
from quads_megatron.kernels.w4a4_grouped import (
    WGMMA_CHUNK,
    RowTiles,
    _nibble_ptx,
    check_wgmma_order,
    gemm_row_tiles,
    grouped_rows,
)

CHUNK = WGMMA_CHUNK  # K elements per k-step and per operand permutation chunk
ROWS_PER_WARPGROUP = 64


def operand_permutation(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [K]: position L of the "wgmma" operand holds activation element perm[L].

    Inside each 128-chunk, with physical bits P = (t1 t0 w1 w0 q1 q0 s) (code byte 16t + 4w + q of
    a row, s = high nibble), the logical position is L = (w1 w0 s q1 t1 t0 q0): the order in which
    the decode's registers reach wgmma's A fragment (rows g, g+8; k 2t, 2t+1, 2t+8, 2t+9 per k16).
    """
    check_wgmma_order(k)
    p = torch.arange(CHUNK)
    bit = [(p >> i) & 1 for i in range(7)]  # p0 = s, p1 = q0, p2 = q1, p3 = w0, p4 = w1, p5 = t0, p6 = t1
    logical = (bit[4] << 6) | (bit[3] << 5) | (bit[0] << 4) | (bit[2] << 3) | (bit[6] << 2) | (bit[5] << 1) | bit[1]
    inv = torch.empty(CHUNK, dtype=torch.int64)
    inv[logical] = p
    return (torch.arange(0, k, CHUNK)[:, None] + inv[None, :]).reshape(-1).to(device)


def y_box_layout(block_t: int) -> gl.NVMMASharedLayout:
    """Shared layout of a TMA-stored output box, bf16 or fp16 [block_t, 64] (128-byte rows, 128-byte swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([block_t, 64], gl.bfloat16)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _capability_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def usable(device: torch.device, n: int, k: int) -> bool:
    """Whether this kernel runs for weights [N, K] on device: an sm_90 GPU, K % 128 == 0, K >= 256 (a
    one-step K loop does not lower in Triton 3.6), N % 64 == 0."""
    if device.type != "cuda" or k % CHUNK or k < 2 * CHUNK or n % ROWS_PER_WARPGROUP:
        return False
    return _capability_ok(device.index if device.index is not None else torch.cuda.current_device())


def wgmma_config(rows: int, n: int, out_dtype: torch.dtype = torch.bfloat16) -> dict[str, int | bool]:
    """Tiles by grouped rows (tokens * top-k): token tile BT (wgmma N), warps (64 weight rows per
    warpgroup), ring depth, 128-K chunks per step, k-steps per straight-line run; above 1024 rows the
    warp-specialized kernel (loader_warps cp.async warps; maxnreg: the launch's register cap, 80 = two
    CTAs per SM) with persistent CTAs (ctas_per_sm) above 16384 rows. From the H200 sweeps
    (benchmarks/probe_wgmma_tiles.py, 2026-12-02): shallow rings (more CTAs per SM) at decode sizes;
    the warp-specialized kernel 3-6% faster than the one-partition kernel at 8192 and 32768 rows;
    persistent CTAs 3-5% faster at 32768 rows and, with 128-token tiles, at 131072 rows; there (2026-12-03)
    2 chunks per slot with the first one's wgmma in flight under the second one's decode: 1854 -> 1754 us
    at 131072 rows. That 2-slot ring leaves no room for an fp32 output's epilogue scratch (233.5 KB of
    227 KB on the H200): fp32 output keeps the 3-slot, 1-chunk ring. Split consumers (session 8: one
    partition per consumer warpgroup, not kept in step by a barrier per k-step): 1805 -> 1644 us at
    131072 rows, 119.5 -> 116.1 us at 2048 rows (32-token tiles; 114.0 with 2 chunks per slot, where
    the one-partition kernel took ~119), no gain at 32768 rows. Rows past an expert zero-filled
    (mask_rows, session 9), not read from row 0: 78.2 -> 69.3 us at 128 rows, 114.0 -> 104.2 at 2048,
    206.9 -> 184.6 at 8192; with them 64-token split tiles from 3073 rows (4096: 142.2 -> 133.1 us) and
    128-token split tiles from 16385 (32768: BT64 persistent 548.2 -> 463.1 us); at 131072 rows 1640 ->
    1570 in one sweep, 1598 -> 1680 in another (noise of a few %). Narrow tiles (session 10: a tile whose
    expert has at most BT/2 rows left runs half-width wgmmas) with every warp-specialized tile, bit-identical:
    104.0 -> 101.5 us at 2048 rows, 131.3 -> 125.3 at 4096, 183.0 -> 178.9 at 8192, 300.8 -> 296.1 at
    16384, 463.8 -> 453.4 at 32768; at 131072 a wash (1606 -> 1558 in one sweep, 1576 -> 1592 in another).
    Session 13 (2026-12-04), bit-identical: three consumer warpgroups (192 weight rows per CTA, N % 192 == 0:
    fc1; a third fewer activation bytes per MAC through the loader; no in-slot overlap at their 136
    registers) 1549-1574 -> 1448 us at 131072 rows, 449 -> 431 at 32768; TMA stores of full tiles (128-row
    CTAs) 1544 -> 1530 and 1574 -> 1549 at 131072 rows, within noise elsewhere."""
    if rows <= 1024:
        cfg = dict(block_t=16, num_warps=8, stages=3, chunks=1, unroll=1)
    elif rows <= 3072:
        cfg = dict(block_t=32, num_warps=8, stages=3, chunks=2, unroll=1, loader_warps=4, maxnreg=80, ctas_per_sm=0)
    elif rows <= 16384:
        cfg = dict(block_t=64, num_warps=8, stages=3, chunks=1, unroll=1, loader_warps=4, maxnreg=80, ctas_per_sm=0)
    elif n % 192 == 0 and out_dtype.itemsize == 2:  # three consumer warpgroups: 192 weight rows per CTA
        cfg = dict(block_t=128, num_warps=12, stages=2, chunks=2, unroll=1, loader_warps=4, maxnreg=128, ctas_per_sm=1)
    else:
        cfg = dict(block_t=128, num_warps=8, stages=2, chunks=2, unroll=2, loader_warps=4, maxnreg=168, ctas_per_sm=1)
        if out_dtype.itemsize > 2:
            cfg.update(stages=3, chunks=1, unroll=1)
    cfg.update(split=rows > 1024, mask_rows=True, narrow=rows > 1024)
    # full tiles by TMA stores: persistent 128-weight-row CTAs (~1% at 131072 rows; 192 rows: no shared memory left)
    cfg.update(tma_store=cfg.get("ctas_per_sm", 0) > 0 and cfg["num_warps"] == 8 and out_dtype.itemsize == 2)
    if n % (ROWS_PER_WARPGROUP * cfg["num_warps"] // 4):  # N a multiple of 64 only: one warpgroup, one partition
        cfg.update(block_t=min(cfg["block_t"], 64), num_warps=4, loader_warps=0, maxnreg=None, ctas_per_sm=0)
        cfg.update(stages=3, chunks=1, unroll=1, split=False, narrow=False, tma_store=False)
    return cfg


def _codes_layout(num_warps: int) -> gl.DistributedLinearLayout:
    """Code bytes of a k-step as [rows, 8 scale blocks, 8 bytes]: a thread holds 16 contiguous bytes
    (two blocks) of rows g and g+8 of its warp's 16 rows (lane = 4g + t, bytes 16t..16t+15)."""
    warps = [[16 << i, 0, 0] for i in range((num_warps // 4).bit_length() + 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [8, 0, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=warps,
        block_bases=[],
        shape=[ROWS_PER_WARPGROUP * num_warps // 4, 8, 8],
    )


# Triton 3.6 spells the CTA barrier thread_barrier, 3.8 barrier
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_PTX_LO = gl.constexpr(_nibble_ptx(False))
_PTX_HI = gl.constexpr(_nibble_ptx(True))


@gluon.jit
def _wait_then_release(PDL: gl.constexpr):
    """pdl.wait_then_release for Gluon: wait for the previous kernel's writes, then let the next one launch."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _decode_a(c, sc, BNW: gl.constexpr, A_LAYOUT: gl.constexpr):
    """Code bytes u8 [BNW, 8, 8] and scale bytes u8 [BNW, 8] of one k-step -> fp16 [BNW, 128]
    value * s_b * 2^-7 in wgmma's register-operand layout (no data movement: asserted)."""
    s16 = gl.expand_dims(sc.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 128.0, 2)
    lo = gl.inline_asm_elementwise(_PTX_LO, "=r,=r,r", [c], dtype=gl.float16, is_pure=True, pack=4) * s16
    hi = gl.inline_asm_elementwise(_PTX_HI, "=r,=r,r", [c], dtype=gl.float16, is_pure=True, pack=4) * s16
    v = gl.reshape(gl.join(lo, hi), [BNW, 2, 2, 2, 2, 2, 2, 2])  # n, t1, t0, w1, w0, q1, q0, s
    v = gl.reshape(gl.permute(v, [0, 3, 4, 7, 5, 1, 2, 6]), [BNW, 128])  # n, w1, w0, s, q1, t1, t0, q0
    return gl.convert_layout(v, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _alloc_ring(SLOTS: gl.constexpr, BT: gl.constexpr, BNW: gl.constexpr):
    """Shared-memory ring of SLOTS buffers, each one 128-K chunk: activation rows fp16 [BT, 128]
    (wgmma's B layout), code bytes u8 [BNW, 64] and scale bytes u8 [BNW, 8] (192 rows: in buffers of 256,
    shapes being powers of 2)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    b_smem = gl.allocate_shared_memory(
        gl.float16, [SLOTS, BT, 128], gl.NVMMASharedLayout.get_default_for([BT, 128], gl.float16)
    )
    ROWS: gl.constexpr = 256 if BNW == 192 else BNW
    w_smem = gl.allocate_shared_memory(gl.uint8, [SLOTS, ROWS, 64], plain)
    s_smem = gl.allocate_shared_memory(gl.uint8, [SLOTS, ROWS, 8], plain)
    return b_smem, w_smem, s_smem


@gluon.jit
def _decode_and_mma(
    b_smem, w_smem, s_smem, buf, acc, BNW: gl.constexpr, CODES_LAYOUT: gl.constexpr, ROW0: gl.constexpr = 0
):
    """Decode ring buffer buf's codes (its weight rows ROW0 .. ROW0 + BNW) into wgmma's register operand
    and issue the (async) wgmma against its activation rows; the caller retires it."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    w_buf = w_smem.index(buf).reshape([w_smem.shape[1], 8, 8])
    s_buf = s_smem.index(buf)
    if BNW != w_smem.shape[1]:  # one warpgroup's rows of the slot (split consumers)
        w_buf = w_buf.slice(ROW0, BNW)
        s_buf = s_buf.slice(ROW0, BNW)
    c = w_buf.load(CODES_LAYOUT)
    sc = s_buf.load(gl.SliceLayout(2, CODES_LAYOUT))
    a = _decode_a(c, sc, BNW, a_layout)
    b = b_smem.index(buf)
    if acc.shape[1] != b_smem.shape[1]:  # a narrow tile: the slot's first rows (whole 8-row swizzle atoms)
        b = b.slice(0, acc.shape[1])
    return hopper.warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)


@gluon.jit
def _issue_step(
    b_smem, w_smem, s_smem, b_ptrs, w_ptrs, s_ptrs, b_rows, step, slot, KC: gl.constexpr, MASK_ROWS: gl.constexpr
):
    """cp.async the activation rows, code bytes and scale bytes of k-step `step` (KC chunks) into `slot`;
    MASK_ROWS: activation rows outside b_rows (bool [BT, 1]) are zero-filled, not read."""
    for ch in gl.static_range(KC):
        j = step * KC + ch
        b_mask = b_rows if MASK_ROWS else None
        async_copy.async_copy_global_to_shared(b_smem.index(slot * KC + ch), b_ptrs + j * 128, mask=b_mask)
        async_copy.async_copy_global_to_shared(w_smem.index(slot * KC + ch), w_ptrs + j * 64)
        async_copy.async_copy_global_to_shared(s_smem.index(slot * KC + ch), s_ptrs + j * 8)


@gluon.jit
def _tile_coords(tmap_ptr, pid):
    """Row tile pid -> (expert e, first grouped row t0, end of e's rows) from tile_map, one round trip;
    e = -1 past the last tile."""
    return gl.load(tmap_ptr + pid * 4), gl.load(tmap_ptr + pid * 4 + 1), gl.load(tmap_ptr + pid * 4 + 2)


@gluon.jit
def _tile_scales(
    arows_ptr,
    asdec_ptr,
    wsdec_ptr,
    e,
    t0,
    row_end,
    wsdec_stride,
    HAS_AROWS: gl.constexpr,
    BT: gl.constexpr,
    LAYOUT: gl.constexpr,
):
    """The epilogue's decode scales of a tile from global memory: S_dec_a of rows t0 .. t0 + BT (their
    tokens' with HAS_AROWS; 0 past row_end), fp32 [BT] in LAYOUT, and S_dec_w[e]."""
    cols = t0 + gl.arange(0, BT, layout=LAYOUT)
    cmask = cols < row_end
    if HAS_AROWS:
        ctok = gl.load(arows_ptr + cols, mask=cmask, other=0).to(gl.int64)
    else:
        ctok = cols.to(gl.int64)
    return gl.load(asdec_ptr + ctok, mask=cmask, other=0.0), gl.load(wsdec_ptr + e * wsdec_stride)


@gluon.jit
def _staged_scales(sa_smem, t, P):
    """The sa_smem buffer of this CTA's tile t (every P-th tile): the loader's and the consumers' one rule."""
    return sa_smem.index((t // P) % sa_smem.shape[0])


@gluon.jit
def _scaled_output(acc, sa, sw, dtype: gl.constexpr):
    """The tile's output acc^T's values: acc [BNW, BT] * 2^14 (undoing 2^-7 on each operand) * S_dec_a of each
    row (sa, fp32 [BT]) * S_dec_w (sw), in y's dtype; both epilogues' one rule."""
    return ((acc * 16384.0) * sa[None, :] * sw).to(dtype)


@gluon.jit
def _store_tile(acc, sa, sw, y_ptr, t0, n0, row_end, N, BT: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr):
    """y[t0:t0+BT, n0:n0+BNW] = acc^T * 2^14 * sa[row] * sw (rows past row_end masked); sa: fp32 [BT] in
    SliceLayout(0, MMA), the rows' S_dec_a; sw: S_dec_w of the tile's expert."""
    BNW: gl.constexpr = 64 * (NW // 4)
    y = _scaled_output(acc, sa, sw, y_ptr.dtype.element_ty)
    out: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, NW], [0, 1])  # 16 B of one row's N per thread
    y = gl.convert_layout(y, out)
    on = n0 + gl.arange(0, BNW, layout=gl.SliceLayout(1, out))
    orow = t0 + gl.arange(0, BT, layout=gl.SliceLayout(0, out))
    gl.store(y_ptr + orow.to(gl.int64)[None, :] * N + on[:, None], y, mask=(orow < row_end)[None, :])


@gluon.jit
def _store_tile_tma(acc, sa, sw, y_ptr, y_desc, y_buf, t0, n0, row_end, N, BT: gl.constexpr, MMA: gl.constexpr):
    """_store_tile for one consumer warpgroup (64 columns) through its staging buffer y_buf (y's dtype [BT_full,
    64], y_desc's layout): a full tile (BT rows, all before row_end) leaves by one TMA bulk store that the
    warpgroup does not wait for; a partial one (an expert's last rows, or a narrow tile) is read back from y_buf
    and stored with the rows past row_end masked, since a box store would overwrite the next expert's rows.
    Waits for the warpgroup's previous bulk store to have read y_buf before writing it."""
    y = _scaled_output(acc, sa, sw, y_ptr.dtype.element_ty)  # [64, BT]
    if BT != y_buf.shape[0]:  # a narrow tile: the buffer's first rows
        y_buf = y_buf.slice(0, BT)
    hopper.tma.store_wait(0)  # (the issuing thread's) previous store has read y_buf ...
    _cta_barrier()  # ... before anyone writes it
    y_buf.permute((1, 0)).store(y)
    if BT == y_desc.block_shape[0] and t0 + BT <= row_end:
        hopper.fence_async_shared()  # the shared stores are visible to the bulk copy (async proxy) ...
        _cta_barrier()  # ... of every thread
        hopper.tma.async_copy_shared_to_global(y_desc, [t0, n0], y_buf)
    else:
        _cta_barrier()
        out: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [BT, 64]: 16 B of a row per thread
        orow = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, out))
        on = n0 + gl.arange(0, 64, layout=gl.SliceLayout(0, out))
        gl.store(y_ptr + orow.to(gl.int64)[:, None] * N + on[None, :], y_buf.load(out), mask=(orow < row_end)[:, None])


@gluon.jit
def _w4a4_wgmma_kernel(
    a_ptr,
    asdec_ptr,
    w_ptr,
    ws_ptr,
    wsdec_ptr,
    tmap_ptr,
    arows_ptr,
    y_ptr,
    N,
    wsdec_stride,
    K: gl.constexpr,
    HAS_AROWS: gl.constexpr,
    BT: gl.constexpr,
    STAGES: gl.constexpr,
    KC: gl.constexpr,
    UNROLL: gl.constexpr,
    NW: gl.constexpr,
    CODES_LAYOUT: gl.constexpr,
    MASK_ROWS: gl.constexpr,
    PDL: gl.constexpr,
):
    _wait_then_release(PDL)
    BNW: gl.constexpr = 64 * (NW // 4)
    NK: gl.constexpr = K // (128 * KC)  # k-steps of KC chunks
    pid = gl.program_id(1)  # N tiles vary fastest: a token tile's rows are re-read from L2, not HBM
    e, t0, row_end = _tile_coords(tmap_ptr, pid)
    if e < 0:
        return
    n0 = gl.program_id(0) * BNW

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 16])
    b_copy: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])  # [BT, 128] fp16, 16 B each
    w_copy: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [1, 0])  # [BNW, 64] u8
    s_copy: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NW, 1], [1, 0])  # [BNW, 8] u8
    b_smem, w_smem, s_smem = _alloc_ring(STAGES * KC, BT, BNW)  # buffer slot * KC + chunk

    r = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, b_copy))
    if HAS_AROWS:
        tok = gl.load(arows_ptr + r, mask=r < row_end, other=0).to(gl.int64)
    else:
        tok = gl.where(r < row_end, r, 0).to(gl.int64)  # rows past the expert copy row 0 (never stored) ...
    b_rows = (r < row_end)[:, None]  # ... or, with MASK_ROWS, are zero-filled without a read
    b_ptrs = a_ptr + tok[:, None] * K + gl.arange(0, 128, layout=gl.SliceLayout(0, b_copy))[None, :]
    wr = (e * N + n0 + gl.arange(0, BNW, layout=gl.SliceLayout(1, w_copy))).to(gl.int64)
    w_ptrs = w_ptr + wr[:, None] * (K // 2) + gl.arange(0, 64, layout=gl.SliceLayout(0, w_copy))[None, :]
    sr = (e * N + n0 + gl.arange(0, BNW, layout=gl.SliceLayout(1, s_copy))).to(gl.int64)
    s_ptrs = ws_ptr + sr[:, None] * (K // 16) + gl.arange(0, 8, layout=gl.SliceLayout(0, s_copy))[None, :]

    # k-steps in flight ahead of the one computed: a slot is refilled once every warpgroup has retired
    # the wgmmas that read it, i.e. after the next barrier if each step ends with wait(0) (UNROLL 1),
    # one barrier later if a wgmma may still be in flight there
    AHEAD: gl.constexpr = STAGES - 1 if UNROLL == 1 else STAGES - 2
    for i in gl.static_range(AHEAD):  # prologue: k-steps 0 .. AHEAD-1
        if i < NK:
            _issue_step(b_smem, w_smem, s_smem, b_ptrs, w_ptrs, s_ptrs, b_rows, i, i, KC, MASK_ROWS)
        async_copy.commit_group()

    acc = gl.zeros([BNW, BT], gl.float32, layout=mma)
    for run in range(NK // UNROLL):
        # UNROLL k-steps of straight-line code: each chunk's decode overlaps the previous chunk's
        # wgmma (wait(1)); the run ends with wait(0), so no wgmma is in flight across the back edge
        # (there ptxas reused the register operand while wgmma still read it; see sass_hazards)
        for uu in gl.static_range(UNROLL):
            kk = run * UNROLL + uu
            slot = kk % STAGES
            async_copy.wait_group(AHEAD - 1)  # this thread's copies of k-step kk have landed
            hopper.fence_async_shared()  # ... and are visible to wgmma's (async proxy) reads
            _cta_barrier()  # everyone's are; the wgmmas of k-step kk+AHEAD-STAGES have retired
            nxt = kk + AHEAD
            if nxt < NK:  # refill the slot k-step kk+AHEAD-STAGES used
                _issue_step(b_smem, w_smem, s_smem, b_ptrs, w_ptrs, s_ptrs, b_rows, nxt, nxt % STAGES, KC, MASK_ROWS)
            async_copy.commit_group()
            for ch in gl.static_range(KC):
                acc = _decode_and_mma(b_smem, w_smem, s_smem, slot * KC + ch, acc, BNW, CODES_LAYOUT)
                if uu * KC + ch == UNROLL * KC - 1:
                    acc = hopper.warpgroup_mma_wait(0, deps=[acc])
                else:
                    acc = hopper.warpgroup_mma_wait(1, deps=[acc])
    async_copy.wait_group(0)

    sa, sw = _tile_scales(
        arows_ptr, asdec_ptr, wsdec_ptr, e, t0, row_end, wsdec_stride, HAS_AROWS, BT, gl.SliceLayout(0, mma)
    )
    _store_tile(acc, sa, sw, y_ptr, t0, n0, row_end, N, BT, NW, mma)


@gluon.jit
def _ws_loader(
    a_ptr,
    asdec_ptr,
    w_ptr,
    ws_ptr,
    arows_ptr,
    tmap_ptr,
    b_smem,
    w_smem,
    s_smem,
    sa_smem,
    ready,
    empty,
    N,
    P,
    K: gl.constexpr,
    HAS_AROWS: gl.constexpr,
    A_I64: gl.constexpr,
    BT: gl.constexpr,
    BNW: gl.constexpr,
    LW: gl.constexpr,
    MASK_ROWS: gl.constexpr,
    STAGED: gl.constexpr,
    PDL: gl.constexpr,
):
    """Worker partition (LW warps): for each of this CTA's tiles, cp.async each k-step's activation rows,
    code and scale bytes (KC 128-K chunks, one ring buffer each) into the next ring slot once the
    consumers freed it (empty), then arm ready[slot] to complete when this thread's copies land
    (cp.async.mbarrier.arrive.noinc: ready counts LW * 32 arrivals). The ring runs on across tiles: the
    next tile's first steps load during this one's last MMAs and epilogue. Offsets are int32 from
    per-step scalar bases; A_I64: token offsets need int64. MASK_ROWS: activation rows past the expert
    are zero-filled without a read (else they copy row 0). STAGED: with a tile's first k-step it also
    copies the tile's S_dec_a (one fp32 per row, 0 past the expert) into sa_smem buffer (tile number) %
    SA_BUFS for the consumers' epilogue, so that its dependent loads (row -> token -> scale) are off
    their path."""
    STAGES: gl.constexpr = ready.shape[0]
    KC: gl.constexpr = b_smem.shape[0] // STAGES
    b_copy: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LW, 1], [1, 0])  # [BT, 128] fp16, 16 B each
    PIECE: gl.constexpr = 64 if BNW == 192 else BNW  # weight rows per copy (a power of 2)
    w_copy: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [LW, 1], [1, 0])  # [PIECE, 64] u8
    if PIECE % (32 * LW) == 0:
        s_copy: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [LW, 1], [1, 0])  # [PIECE, 8] u8, a row per thread
    else:  # (64-row pieces) half a row per thread
        s_copy: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [LW, 1], [1, 0])
    sa_copy: gl.constexpr = gl.BlockedLayout([1], [32], [LW], [0])  # [BT] fp32, one row per thread
    w_off = (
        gl.arange(0, PIECE, layout=gl.SliceLayout(1, w_copy))[:, None] * (K // 2)
        + gl.arange(0, 64, layout=gl.SliceLayout(0, w_copy))[None, :]
    )
    s_off = (
        gl.arange(0, PIECE, layout=gl.SliceLayout(1, s_copy))[:, None] * (K // 16)
        + gl.arange(0, 8, layout=gl.SliceLayout(0, s_copy))[None, :]
    )
    _wait_then_release(PDL)
    n_tiles = N // BNW
    it = 0  # k-steps issued by this CTA so far: ring slot and phase
    for t in range(gl.program_id(0), gl.load(tmap_ptr + 3) * n_tiles, P):
        e, t0, row_end = _tile_coords(tmap_ptr, t // n_tiles)
        r = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, b_copy))
        if HAS_AROWS:
            tok = gl.load(arows_ptr + r, mask=r < row_end, other=0)
        else:
            tok = gl.where(r < row_end, r, 0)  # rows past the expert copy row 0 (never stored)
        b_rows = (r < row_end)[:, None]
        if A_I64:
            tok = tok.to(gl.int64)
        else:
            tok = tok.to(gl.int32)
        b_off = tok[:, None] * K + gl.arange(0, 128, layout=gl.SliceLayout(0, b_copy))[None, :]
        row0 = (e * N + (t % n_tiles) * BNW).to(gl.int64)
        sa_r = t0 + gl.arange(0, BT, layout=sa_copy)
        if HAS_AROWS and STAGED:
            sa_tok = gl.load(arows_ptr + sa_r, mask=sa_r < row_end, other=0)
        else:
            sa_tok = sa_r
        for j in range(K // (128 * KC)):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
            if STAGED and j == 0:  # lands with this k-step; the buffer's previous tile is done (see SA_BUFS)
                async_copy.async_copy_global_to_shared(
                    _staged_scales(sa_smem, t, P), asdec_ptr + sa_tok, mask=sa_r < row_end
                )
            for ch in gl.static_range(KC):
                c = j * KC + ch
                buf = slot * KC + ch
                b_mask = b_rows if MASK_ROWS else None
                async_copy.async_copy_global_to_shared(b_smem.index(buf), (a_ptr + c * 128) + b_off, mask=b_mask)
                for pc in gl.static_range(BNW // PIECE):  # weight rows in pieces (192: three of 64)
                    w_dst = w_smem.index(buf).slice(pc * PIECE, PIECE)
                    s_dst = s_smem.index(buf).slice(pc * PIECE, PIECE)
                    prow = row0 + pc * PIECE
                    async_copy.async_copy_global_to_shared(w_dst, (w_ptr + prow * (K // 2) + c * 64) + w_off)
                    async_copy.async_copy_global_to_shared(s_dst, (ws_ptr + prow * (K // 16) + c * 8) + s_off)
            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
            it += 1


@gluon.jit
def _ws_tile(
    b_smem,
    w_smem,
    s_smem,
    sa_smem,
    ready,
    empty,
    it,
    t,
    P,
    n_tiles,
    e,
    t0,
    row_end,
    arows_ptr,
    asdec_ptr,
    wsdec_ptr,
    y_ptr,
    y_desc,
    y_smem,
    N,
    wsdec_stride,
    K: gl.constexpr,
    HAS_AROWS: gl.constexpr,
    BT: gl.constexpr,
    NW: gl.constexpr,
    CODES_LAYOUT: gl.constexpr,
    OVERLAP: gl.constexpr,
    ROW0: gl.constexpr,
    STAGED: gl.constexpr,
    CTA_ROWS: gl.constexpr,
):
    """One tile of a consumer partition, from ring k-step `it` on: per k-step wait for its slot; per
    128-K chunk decode the codes into wgmma's register operand, wgmma against the slot's first BT
    activation rows and retire it (wait(0)), or with OVERLAP leave it in flight under the next chunk's
    decode inside the slot (wait(1); the slot's last chunk retires all: nothing in flight across the
    back edge); free the slot. Then the tile's epilogue: y rows t0 .. t0 + BT, the 64 * NW / 4 columns of
    this partition in N tile t % n_tiles; STAGED: S_dec_a from the loader's copy in sa_smem (it landed
    with the tile's first k-step) and S_dec_w loaded before the K loop, else both loaded there; y_desc
    (not None): through this warpgroup's staging buffer y_smem[ROW0 // 64] (_store_tile_tma). Returns the
    ring's next k-step."""
    BNW: gl.constexpr = 64 * (NW // 4)
    STAGES: gl.constexpr = ready.shape[0]
    KC: gl.constexpr = b_smem.shape[0] // STAGES
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 16])
    acc = gl.zeros([BNW, BT], gl.float32, layout=mma)
    if STAGED:
        sw = gl.load(wsdec_ptr + e * wsdec_stride)  # in flight during the K loop
    for _ in range(K // (128 * KC)):
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        hopper.fence_async_shared()  # the cp.async writes are visible to wgmma's (async proxy) reads
        for ch in gl.static_range(KC):
            acc = _decode_and_mma(b_smem, w_smem, s_smem, slot * KC + ch, acc, BNW, CODES_LAYOUT, ROW0)
            if OVERLAP and ch < KC - 1:
                acc = hopper.warpgroup_mma_wait(1, deps=[acc])
            else:
                acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(slot), count=1)
        it += 1
    n0 = (t % n_tiles) * CTA_ROWS + ROW0
    if STAGED:
        sa_buf = _staged_scales(sa_smem, t, P)
        if BT != sa_smem.shape[1]:  # a narrow tile: its first rows
            sa_buf = sa_buf.slice(0, BT)
        sa = sa_buf.load(gl.SliceLayout(0, mma))
    else:
        sa, sw = _tile_scales(
            arows_ptr, asdec_ptr, wsdec_ptr, e, t0, row_end, wsdec_stride, HAS_AROWS, BT, gl.SliceLayout(0, mma)
        )
    if y_desc is None:
        _store_tile(acc, sa, sw, y_ptr, t0, n0, row_end, N, BT, NW, mma)
    else:
        _store_tile_tma(acc, sa, sw, y_ptr, y_desc, y_smem.index(ROW0 // 64), t0, n0, row_end, N, BT, mma)
    return it


@gluon.jit
def _ws_consumer(
    b_smem,
    w_smem,
    s_smem,
    sa_smem,
    ready,
    empty,
    tmap_ptr,
    arows_ptr,
    asdec_ptr,
    wsdec_ptr,
    y_ptr,
    y_desc,
    y_smem,
    N,
    P,
    wsdec_stride,
    K: gl.constexpr,
    HAS_AROWS: gl.constexpr,
    BT: gl.constexpr,
    NW: gl.constexpr,
    CODES_LAYOUT: gl.constexpr,
    OVERLAP: gl.constexpr,
    ROW0: gl.constexpr,
    NARROW: gl.constexpr,
    STAGED: gl.constexpr,
    PDL: gl.constexpr,
    CTA_ROWS: gl.constexpr,
):
    """Consumer partition (NW warps, 64 weight rows per warpgroup, from the slot's row ROW0: split
    consumers are one partition per warpgroup; CTA_ROWS: the CTA's weight rows, all partitions): each of
    this CTA's tiles by _ws_tile. NARROW: a tile
    whose expert has at most BT / 2 rows left runs half-width wgmmas (the slot's first BT / 2 activation
    rows; the rest are padding) and a half-width epilogue. OVERLAP needs registers for two decoded
    chunks: at the 104 consumer registers of a two-CTAs-per-SM launch ptxas serializes every wgmma
    instead (128 sufficed at BT32, 176 at BT64, 240 at BT128; sass_wgmma.py). y_desc (not None): tiles
    leave by TMA bulk stores (_store_tile_tma), the last one waited for before the partition ends."""
    _wait_then_release(PDL)
    n_tiles = N // CTA_ROWS  # N tiles of the CTA's weight rows (all consumer partitions)
    it = 0  # k-steps consumed by this CTA so far
    for t in range(gl.program_id(0), gl.load(tmap_ptr + 3) * n_tiles, P):
        e, t0, row_end = _tile_coords(tmap_ptr, t // n_tiles)
        # fmt: off
        if NARROW and row_end - t0 <= BT // 2:  # (NARROW False: no branch, the wide tile alone)
            it = _ws_tile(b_smem, w_smem, s_smem, sa_smem, ready, empty, it, t, P, n_tiles, e, t0, row_end,
                          arows_ptr, asdec_ptr, wsdec_ptr, y_ptr, y_desc, y_smem, N, wsdec_stride, K, HAS_AROWS,
                          BT // 2, NW, CODES_LAYOUT, OVERLAP, ROW0, STAGED, CTA_ROWS)
        else:
            it = _ws_tile(b_smem, w_smem, s_smem, sa_smem, ready, empty, it, t, P, n_tiles, e, t0, row_end,
                          arows_ptr, asdec_ptr, wsdec_ptr, y_ptr, y_desc, y_smem, N, wsdec_stride, K, HAS_AROWS,
                          BT, NW, CODES_LAYOUT, OVERLAP, ROW0, STAGED, CTA_ROWS)
        # fmt: on
    if y_desc is not None:
        hopper.tma.store_wait(0)  # the shared memory stays until the last bulk store has read it


@gluon.jit
def _w4a4_wgmma_ws_kernel(
    a_ptr,
    asdec_ptr,
    w_ptr,
    ws_ptr,
    wsdec_ptr,
    tmap_ptr,
    arows_ptr,
    y_ptr,
    y_desc,
    N,
    wsdec_stride,
    P,
    K: gl.constexpr,
    HAS_AROWS: gl.constexpr,
    BT: gl.constexpr,
    STAGES: gl.constexpr,
    KC: gl.constexpr,
    NW: gl.constexpr,
    LW: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    A_I64: gl.constexpr,
    CODES_LAYOUT: gl.constexpr,
    OVERLAP: gl.constexpr,
    SPLIT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    MASK_ROWS: gl.constexpr,
    NARROW: gl.constexpr,
    STAGED: gl.constexpr,
    PDL: gl.constexpr,
):
    """Warp-specialized variant of _w4a4_wgmma_kernel (KC 128-K chunks per ring slot, 1-step runs): LW
    loader warps fill the ring by cp.async and per-slot mbarriers, the NW consumer warps only decode and
    issue wgmma; no CTA-wide barrier. Triton puts a partition-wide barrier before every mbarrier wait,
    so one consumer partition's warpgroups move in step; SPLIT (NW 8 or 12) makes each warpgroup its own
    partition (CONSUMER_REGS: the second and third ones' registers), which then runs ahead of the others as
    far as the ring allows; NW 12 (192 weight rows per CTA, copied in 64-row pieces into 256-row buffers)
    needs it. MASK_ROWS: activation rows past the expert are zero-filled, not read. NARROW:
    tiles with at most BT / 2 rows left run half-width wgmmas (see _ws_consumer). Tiles (row
    tile, N tile; N fastest) t = program_id, program_id + P, ...: P = the grid, one tile per CTA when it
    covers them all, else persistent CTAs whose ring runs on from one tile into the next. STAGED
    (persistent CTAs): the loader stages each tile's S_dec_a in shared memory for the consumers' epilogue
    (its row -> token -> scale loads stalled the consumers at every tile's end, with the ring running
    on: 1596 -> 1532 us at 131072 rows on the H200); one tile per CTA loads them in the epilogue (at
    2048 rows staging lost: 101.7 -> 105.0 us). y_desc (SPLIT; None: plain stores): a TMA descriptor of y in
    [BT, 64] boxes; each consumer warpgroup stages its output in a shared [BT, 64] buffer (_store_tile_tma)."""
    BNW: gl.constexpr = 64 * (NW // 4)
    b_smem, w_smem, s_smem = _alloc_ring(STAGES * KC, BT, BNW)  # buffer slot * KC + chunk
    # tiles' S_dec_a (STAGED): the loader writes tile i + SA_BUFS's after waiting for the ring slot of its first
    # k-step, which the consumers free only past tile i's epilogue once (SA_BUFS - 1) * NK >= STAGES
    NK: gl.constexpr = K // (128 * KC)
    SA_BUFS: gl.constexpr = 1 + (STAGES + NK - 1) // NK
    sa_smem = gl.allocate_shared_memory(gl.float32, [SA_BUFS, BT], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if y_desc is None:
        y_smem = sa_smem  # (unused)
    else:  # one staging buffer per consumer warpgroup
        y_smem = gl.allocate_shared_memory(y_desc.dtype, [NW // 4, BT, 64], y_desc.layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=LW * 32)
        mbarrier.init(empty.index(i), count=NW // 4 if SPLIT else 1)
    if SPLIT and NW == 12:  # three consumer warpgroups: 192 weight rows per CTA
        gl.warp_specialize(
            [
                (_ws_consumer, (b_smem, w_smem, s_smem, sa_smem, ready, empty, tmap_ptr, arows_ptr, asdec_ptr,
                                wsdec_ptr, y_ptr, y_desc, y_smem, N, P, wsdec_stride, K, HAS_AROWS, BT, 4, CODES_LAYOUT,
                                OVERLAP, 0, NARROW, STAGED, PDL, BNW)),
                (_ws_consumer, (b_smem, w_smem, s_smem, sa_smem, ready, empty, tmap_ptr, arows_ptr, asdec_ptr,
                                wsdec_ptr, y_ptr, y_desc, y_smem, N, P, wsdec_stride, K, HAS_AROWS, BT, 4, CODES_LAYOUT,
                                OVERLAP, 64, NARROW, STAGED, PDL, BNW)),
                (_ws_consumer, (b_smem, w_smem, s_smem, sa_smem, ready, empty, tmap_ptr, arows_ptr, asdec_ptr,
                                wsdec_ptr, y_ptr, y_desc, y_smem, N, P, wsdec_stride, K, HAS_AROWS, BT, 4, CODES_LAYOUT,
                                OVERLAP, 128, NARROW, STAGED, PDL, BNW)),
                (_ws_loader, (a_ptr, asdec_ptr, w_ptr, ws_ptr, arows_ptr, tmap_ptr, b_smem, w_smem, s_smem, sa_smem,
                              ready, empty, N, P, K, HAS_AROWS, A_I64, BT, BNW, LW, MASK_ROWS, STAGED, PDL)),
            ],
            [4, 4, LW],
            [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
        )  # fmt: skip
    elif SPLIT:  # one consumer partition per warpgroup (NW == 8): each runs ahead on its own (see _ws_consumer)
        gl.warp_specialize(
            [
                (_ws_consumer, (b_smem, w_smem, s_smem, sa_smem, ready, empty, tmap_ptr, arows_ptr, asdec_ptr,
                                wsdec_ptr, y_ptr, y_desc, y_smem, N, P, wsdec_stride, K, HAS_AROWS, BT, 4,
                                CODES_LAYOUT, OVERLAP, 0, NARROW, STAGED, PDL, BNW)),
                (_ws_consumer, (b_smem, w_smem, s_smem, sa_smem, ready, empty, tmap_ptr, arows_ptr, asdec_ptr,
                                wsdec_ptr, y_ptr, y_desc, y_smem, N, P, wsdec_stride, K, HAS_AROWS, BT, 4,
                                CODES_LAYOUT, OVERLAP, 64, NARROW, STAGED, PDL, BNW)),
                (_ws_loader, (a_ptr, asdec_ptr, w_ptr, ws_ptr, arows_ptr, tmap_ptr, b_smem, w_smem, s_smem, sa_smem,
                              ready, empty, N, P, K, HAS_AROWS, A_I64, BT, BNW, LW, MASK_ROWS, STAGED, PDL)),
            ],
            [4, LW],
            [CONSUMER_REGS, LOADER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(  # (argument tuples inline: a tuple variable would turn the constexprs into tensors)
            [
                (_ws_consumer, (b_smem, w_smem, s_smem, sa_smem, ready, empty, tmap_ptr, arows_ptr, asdec_ptr,
                                wsdec_ptr, y_ptr, y_desc, y_smem, N, P, wsdec_stride, K, HAS_AROWS, BT, NW,
                                CODES_LAYOUT, OVERLAP, 0, NARROW, STAGED, PDL, BNW)),
                (_ws_loader, (a_ptr, asdec_ptr, w_ptr, ws_ptr, arows_ptr, tmap_ptr, b_smem, w_smem, s_smem, sa_smem,
                              ready, empty, N, P, K, HAS_AROWS, A_I64, BT, BNW, LW, MASK_ROWS, STAGED, PDL)),
            ],
            [LW],
            [LOADER_REGS],
        )  # fmt: skip


def ws_loader_regs(block_t: int, loader_warps: int, chunks: int = 1, cta_rows: int = 128) -> int:
    """Registers per thread of the loader warps: one int32 offset per 16-byte activation copy (BT * 16 /
    (32 * loader_warps) per thread) plus the code and scale offsets, and a second chunk's bases (8 more
    but at 5-8 copies), 8 more for 192 weight rows (copied in 64-row pieces); without spills outside the
    register handoff (sass_wgmma.py, sm_90)."""
    copies = block_t * 16 // (32 * loader_warps)
    regs = (40 if copies <= 4 else 48 if copies <= 8 else 88) + (8 if chunks == 2 and copies not in range(5, 9) else 0)
    return regs + (8 if cta_rows == 192 else 0)


def ws_consumer_regs(maxnreg: int | None, loader_warps: int, loader_regs: int, consumer_warps: int = 8) -> int:
    """Registers per thread of the second (and third) consumer warpgroup of a split warp-specialized launch: an
    equal share (a multiple of 8) of what the launch's cap leaves after the loader; the first warpgroup gets the
    rest. Without a cap, the register file of one CTA per SM."""
    threads = 32 * (consumer_warps + loader_warps)
    budget = (maxnreg or 65536 // threads // 8 * 8) * threads - 32 * loader_warps * loader_regs
    return budget // (32 * consumer_warps) // 8 * 8


def ws_launch_consts(
    block_t: int, num_warps: int, chunks: int, loader_warps: int, maxnreg: int | None, split: bool
) -> dict:
    """The warp-specialized kernel's launch constants that follow from its tile: loader warps and their
    registers, split consumers and the second warpgroup's registers, the code layout of one consumer
    partition and the launch's warps (split: the first consumer warpgroup's; the second one and the
    loader are workers)."""
    loader_regs = ws_loader_regs(block_t, loader_warps, chunks, ROWS_PER_WARPGROUP * num_warps // 4)
    partition_warps = 4 if split else num_warps
    return dict(
        LW=loader_warps,
        LOADER_REGS=loader_regs,
        SPLIT=split,
        CONSUMER_REGS=ws_consumer_regs(maxnreg, loader_warps, loader_regs, num_warps) if split else 0,
        CODES_LAYOUT=_codes_layout(partition_warps),
        num_warps=partition_warps,
    )


def ws_overlap(chunks: int, unroll: int) -> bool:
    """Whether the warp-specialized kernel (1-step runs) keeps a slot's first chunk's wgmma in flight under
    the second one's decode: asked for by unroll > 1, possible with 2 chunks per slot."""
    return chunks == 2 and unroll > 1


def faster_than_triton(rows: int) -> bool:
    """Whether this GEMM beat the Triton GEMM (w4a4_grouped) at this many grouped rows in the H200
    sweeps (2026-12-02, Qwen3-30B-A3B fc1): not at <= 1024 rows (73 / 93 us vs 64 / 91 us at 128 /
    512 rows; session 9, rows past an expert zero-filled: 68.4 / 91.7 vs 65.9 / 92.6, a tie), 5-8%
    faster from 2048 rows up (session 9: 22-31%). moe_w4a4's impl='auto' follows it."""
    return rows > 1024


def run_length(k: int, chunks: int, unroll: int) -> int:
    """k-steps per straight-line run: the largest divisor of the K loop's steps that is <= unroll and
    leaves at least two runs (a single-run loop does not lower in Triton 3.6)."""
    steps = k // (CHUNK * chunks)
    return max(d for d in range(1, max(1, min(unroll, steps // 2)) + 1) if steps % d == 0)


_SASS_CHECKED: dict[str, list[str] | None] = {}  # compiled kernel hash -> hazards (None: SASS unreadable)
_ONE_STEP_RUNS: set[tuple] = set()  # tiles whose multi-step runs (or in-slot overlap) were unsafe or unverifiable


def _register_hazards(kernel) -> list[str] | None:
    """sass_hazards on a compiled kernel, once per compiled variant (a disassembly takes ~0.1-1 s); None
    where its SASS cannot be read (disassemble: the cuobjdump Triton bundles, on the whole cubin)."""
    key = getattr(kernel, "hash", None) or str(id(kernel))
    if key not in _SASS_CHECKED:
        try:
            sass = disassemble(kernel.asm["cubin"])
        except (OSError, RuntimeError, subprocess.CalledProcessError):
            sass = None
        _SASS_CHECKED[key] = None if sass is None else wgmma_register_hazards(sass)
    return _SASS_CHECKED[key]


def grouped_w4a4_wgmma(
    values: torch.Tensor,
    global_decode: torch.Tensor,
    offs: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_sdec: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    a_rows: torch.Tensor | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
    stages: int | None = None,
    chunks: int | None = None,
    unroll: int | None = None,
    maxnreg: int | None = None,
    loader_warps: int | None = None,
    ctas_per_sm: int | None = None,
    split: bool | None = None,
    mask_rows: bool | None = None,
    narrow: bool | None = None,
    tma_store: bool | None = None,
    tiles: RowTiles | None = None,
) -> torch.Tensor:
    """y [rows, N] = S_dec_a * S_dec_w[e] * (A @ W_e^T) for the grouped rows of offs (see grouped_w4a4).

    values: fp16 [M, K] activation operand in the "wgmma" order; global_decode: fp32 [M] or [M, 1]; w_codes u8 [E,
    N, K/2], w_scales u8 [E, N, K/16], w_sdec fp32 [E] (may be strided); a_rows: optional token index of each
    grouped row. Tiles default to wgmma_config(rows, N, out_dtype); chunks: 128-K chunks per pipeline step (1 or 2;
    1 where K is not a multiple of 256); unroll: k-steps per straight-line run (run_length); maxnreg: a register cap
    per thread (None: ptxas decides; the warp-specialized kernel's cap is the launch's, split between its
    partitions); loader_warps: > 0 runs the warp-specialized kernel with that many cp.async loader warps (1-step
    runs; there unroll > 1 with 2 chunks keeps each slot's first chunk's wgmma in flight under the second one's
    decode; 0 the single-partition kernel); ctas_per_sm: its CTAs persist, SMs * ctas_per_sm of them looping over
    the tiles, the loader staging each tile's epilogue scales in shared memory (0: one CTA per tile); split: its two
    consumer warpgroups (num_warps 8) run as two partitions, each on its own 64 weight rows of every slot, instead
    of one partition kept in step by a barrier per k-step (ws_consumer_regs: their register share); mask_rows:
    activation rows past an expert's rows are zero-filled by the copy instead of read from row 0 (every CTA with a
    partial tile re-reads that one row; at 256 tokens half of each tile's rows; None: wgmma_config's, on); narrow
    (warp-specialized kernel, block_t >= 32): a tile whose expert has at most block_t / 2 rows left runs half-width
    wgmmas and epilogue (at 256 tokens about half the tiles; None: wgmma_config's for the configured kernel
    (loader_warps not given) with block_t >= 32, off for tiles given with loader warps); tiles: RowTiles of offs in
    block_t-row tiles made beforehand (w4a4_grouped.row_tiles, or the activation operand's .tiles; block_rows must
    be this call's block_t); None: one tile_map launch here; tma_store (split consumers, bf16/fp16 output): each
    consumer warpgroup stages a full tile's output in shared memory and leaves it to one TMA bulk store (partial
    tiles: masked stores from that buffer; None: wgmma_config's for the configured kernel, off for tiles given
    with loader warps).

    Each compiled tile's SASS is checked once (sass_hazards): multi-step runs whose wgmma register
    operand could be rewritten in flight (or whose SASS cannot be read) fall back to 1-step runs,
    with a warning; a hazard there too raises RuntimeError.
    """
    e_count, n, k_half = w_codes.shape
    k = 2 * k_half
    if values.dim() != 2 or values.shape[1] != k or values.dtype != torch.float16:
        raise ValueError(f"wgmma operand must be fp16 [M, {k}], got {values.dtype} {tuple(values.shape)}")
    if not usable(w_codes.device, n, k):
        raise ValueError(
            f"the Hopper wgmma GEMM needs an sm_90 GPU, K % 128 == 0, K >= 256 and N % 64 == 0 (N={n}, K={k})"
        )
    m, offs, a_rows = grouped_rows(values.shape[0], offs, a_rows, e_count, w_codes.device)
    cfg = wgmma_config(m, n, out_dtype)
    block_t = block_t or cfg["block_t"]
    num_warps = num_warps or cfg["num_warps"]
    stages = stages or cfg["stages"]
    chunks = chunks or cfg["chunks"]
    if loader_warps is None:  # the configured kernel, with its register cap, persistence and consumers
        loader_warps, maxnreg = cfg.get("loader_warps", 0), maxnreg or cfg.get("maxnreg")
        ctas_per_sm = cfg.get("ctas_per_sm", 0) if ctas_per_sm is None else ctas_per_sm
        split = cfg.get("split", False) if split is None and num_warps == cfg["num_warps"] else split
        narrow = cfg["narrow"] and block_t >= 32 if narrow is None else narrow  # config's narrow: loader warps
        tma_store = cfg["tma_store"] and bool(split) if tma_store is None else tma_store
    split, mask_rows, narrow = bool(split), cfg["mask_rows"] if mask_rows is None else bool(mask_rows), bool(narrow)
    tma_store = bool(tma_store)
    if k % (CHUNK * chunks) or (loader_warps and k // (CHUNK * chunks) < 2):  # a 1-step K loop does not lower
        chunks = 1
    overlap = bool(loader_warps) and ws_overlap(chunks, unroll or cfg["unroll"])
    unroll = 1 if loader_warps else run_length(k, chunks, unroll or cfg["unroll"])
    min_stages = 2 if unroll == 1 else 3  # at least one k-step in flight ahead (see AHEAD in the kernel)
    warps_ok = (4, 8, 12, 16) if loader_warps else (4, 8)
    bad_warps = num_warps not in warps_ok or n % (ROWS_PER_WARPGROUP * num_warps // 4)
    bad_loader = loader_warps not in (0, 1, 2, 4) or 32 * loader_warps > ROWS_PER_WARPGROUP * num_warps // 4
    bad_split = (split and (not loader_warps or num_warps not in (8, 12))) or (num_warps == 12 and not split)
    bad_narrow = narrow and (not loader_warps or block_t < 32)
    bad_tma = tma_store and (not split or out_dtype.itemsize != 2)
    if bad_warps or stages < min_stages or chunks not in (1, 2) or bad_loader or bad_split or bad_narrow or bad_tma:
        raise ValueError(
            f"bad tiles: num_warps={num_warps} (4 or 8, 12 or 16 with loader warps; N % (16 * warps) == 0), "
            f"stages={stages} (>= {min_stages} with {unroll}-step runs), chunks={chunks} (1 or 2), loader_warps="
            f"{loader_warps} (0, 1, 2 or 4, at most one per 32 weight rows of a CTA), split={split} (with "
            f"loader warps and num_warps 8 or 12; 12 needs it), narrow={narrow} (with loader warps and block_t >= 32 "
            f"only), tma_store={tma_store} (split consumers and a 2-byte output only)"
        )
    dev = w_codes.device
    tiles = gemm_row_tiles(tiles, offs, block_t, m)
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    grid = (n // (ROWS_PER_WARPGROUP * num_warps // 4), tiles.table.shape[0])  # row tiles: an upper bound
    args = (
        values,
        global_decode.reshape(-1).float(),
        w_codes,
        w_scales,
        w_sdec,
        tiles.table,
        offs if a_rows is None else a_rows,
        y,
        n,
        w_sdec.stride(0),
    )
    consts = dict(K=k, HAS_AROWS=a_rows is not None, BT=block_t, MASK_ROWS=mask_rows)
    consts.update(STAGES=stages, NW=num_warps, CODES_LAYOUT=_codes_layout(num_warps), num_warps=num_warps)
    consts.update(pdl.launch_options(dev))
    if maxnreg:
        consts["maxnreg"] = maxnreg
    if loader_warps:
        staged = bool(ctas_per_sm)  # persistent CTAs stage the epilogue's scales
        consts.update(KC=chunks, A_I64=values.shape[0] * k >= 2**31, NARROW=narrow, STAGED=staged)
        consts.update(ws_launch_consts(block_t, num_warps, chunks, loader_warps, maxnreg, split))
        tiles_ub = grid[0] * grid[1]  # row tiles are known on the device only: their upper bound
        p = min(tiles_ub, _sm_count(dev) * ctas_per_sm) if ctas_per_sm else tiles_ub
        tile = ("ws", k, a_rows is not None, block_t, stages, num_warps, loader_warps, maxnreg, out_dtype)
        tile += (split, mask_rows, narrow, staged, tma_store)
        y_desc = TensorDescriptor.from_tensor(y, [block_t, 64], y_box_layout(block_t)) if tma_store else None
        ws_args = (*args[:8], y_desc, *args[8:], p)
        _launch_verified(
            lambda risky: _w4a4_wgmma_ws_kernel[(p,)](*ws_args, OVERLAP=risky, **consts),
            overlap,
            tile,
            "in-slot overlap",
            "retiring each chunk",
        )
        return y
    consts["KC"] = chunks
    tile = (k, a_rows is not None, block_t, stages, chunks, num_warps, maxnreg, out_dtype, unroll, mask_rows)
    _launch_verified(
        lambda risky: _w4a4_wgmma_kernel[grid](*args, UNROLL=unroll if risky else 1, **consts),
        unroll > 1,
        tile,
        f"{unroll}-step runs",
        "using 1-step runs",
    )
    return y


def _launch_verified(launch, risky: bool, tile: tuple, what: str, safe: str) -> None:
    """launch(risky) -> the compiled kernel, its SASS checked (sass_hazards). risky: the form that keeps
    a wgmma in flight under the next decode (multi-step runs, in-slot overlap). Where that form shows a
    register hazard or its SASS cannot be read: warn, remember the tile (never risky again) and relaunch
    the safe form; a hazard there raises RuntimeError rather than return a wrong tile."""
    risky = risky and tile not in _ONE_STEP_RUNS
    found = _register_hazards(launch(risky))
    if risky and found != []:
        why = "its SASS could not be read" if found is None else f"{len(found)} register hazards"
        warnings.warn(f"Gluon GEMM: {what} not verified ({why}); {safe}", stacklevel=3)
        _ONE_STEP_RUNS.add(tile)
        found = _register_hazards(launch(False))
    if found:
        raise RuntimeError(f"wgmma register hazard in the compiled Gluon GEMM (sass_hazards): {found[:3]}")
