"""Hopper (sm_90) grouped W4A4 GEMM in Gluon, device code: FP4 weights decoded straight into wgmma's
register operand. The host side (tiles, checks, launch) is gemm_wgmma_launch.

The product is computed transposed, y^T[n, row] = W_e[n, :] . A[row, :], so the decoded weights are
wgmma's A operand, which may live in registers (no shared-memory round trip for them), and the token
rows (few per expert at decode sizes) are wgmma's N, which can be as small as 8. Each warpgroup owns
64 weight rows; a k-step covers 128 elements (64 code bytes per row, 16 per thread). Each thread's
decoded values must land in the registers wgmma reads for its lane, which fixes a permutation of K
inside every 128-element chunk: the activation operand is written in that order (act_quant, order
"wgmma"), so the GEMM only copies its rows.

w4a4_wgmma_kernel: one partition; activation rows, code and scale bytes arrive by cp.async in a
STAGES-deep ring; the K loop runs in straight-line runs of UNROLL k-steps (each decode overlaps the
previous wgmma, each run ends with wait(0)): ptxas may reuse a register operand of a wgmma left in
flight across the loop's back edge, which sass_check.wgmma_register_hazards finds in the SASS.
w4a4_wgmma_ws_kernel: warp-specialized; LW loader warps fill the ring (per-slot mbarriers), the
consumer warps only wait, decode, wgmma and free the slot, optionally one partition per consumer
warpgroup (split) and persistent CTAs. Every CTA reads its tile from a row-tile table
(row_tiles.RowTiles). Both wait for the previous kernel before their first read (pdl).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from quads_megatron.kernels.gluon_device import (
    decode_weights,
    l2_prefetch_chunk,
    tile_coords,
    tile_scales,
    wait_then_release,
    weight_chunk_offset,
    weight_row_base,
)

ROWS_PER_WARPGROUP = 64  # weight rows per consumer warpgroup (wgmma's M)


def y_box_layout(block_t: int) -> gl.NVMMASharedLayout:
    """Shared layout of a TMA-stored output box, bf16 or fp16 [block_t, 64] (128-byte rows, 128-byte swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([block_t, 64], gl.bfloat16)


def codes_layout(num_warps: int) -> gl.DistributedLinearLayout:
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
    a = decode_weights(c, sc, BNW, a_layout)
    b = b_smem.index(buf)
    if acc.shape[1] != b_smem.shape[1]:  # a narrow tile: the slot's first rows (whole 8-row swizzle atoms)
        b = b.slice(0, acc.shape[1])
    return hopper.warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)


@gluon.jit
def _issue_step(
    b_smem,
    w_smem,
    s_smem,
    b_ptrs,
    w_ptrs,
    s_ptrs,
    b_rows,
    step,
    slot,
    KC: gl.constexpr,
    MASK_ROWS: gl.constexpr,
    TILED: gl.constexpr,
):
    """cp.async the activation rows, code bytes and scale bytes of k-step `step` (KC chunks) into `slot`;
    MASK_ROWS: activation rows outside b_rows (bool [BT, 1]) are zero-filled, not read. TILED: the weights in
    weight_layout's tiled order (a chunk's next one 16 x further)."""
    for ch in gl.static_range(KC):
        j = step * KC + ch
        b_mask = b_rows if MASK_ROWS else None
        async_copy.async_copy_global_to_shared(b_smem.index(slot * KC + ch), b_ptrs + j * 128, mask=b_mask)
        async_copy.async_copy_global_to_shared(w_smem.index(slot * KC + ch), w_ptrs + weight_chunk_offset(j, 64, TILED))
        async_copy.async_copy_global_to_shared(s_smem.index(slot * KC + ch), s_ptrs + weight_chunk_offset(j, 8, TILED))


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
def w4a4_wgmma_kernel(
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
    TILED: gl.constexpr = False,
):
    wait_then_release(PDL)
    BNW: gl.constexpr = 64 * (NW // 4)
    NK: gl.constexpr = K // (128 * KC)  # k-steps of KC chunks
    pid = gl.program_id(1)  # N tiles vary fastest: a token tile's rows are re-read from L2, not HBM
    e, t0, row_end = tile_coords(tmap_ptr, pid)
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
    w_ptrs = (
        w_ptr
        + weight_row_base(wr, K // 2, 64, TILED)[:, None]
        + gl.arange(0, 64, layout=gl.SliceLayout(0, w_copy))[None, :]
    )
    sr = (e * N + n0 + gl.arange(0, BNW, layout=gl.SliceLayout(1, s_copy))).to(gl.int64)
    s_ptrs = (
        ws_ptr
        + weight_row_base(sr, K // 16, 8, TILED)[:, None]
        + gl.arange(0, 8, layout=gl.SliceLayout(0, s_copy))[None, :]
    )

    # k-steps in flight ahead of the one computed: a slot is refilled once every warpgroup has retired
    # the wgmmas that read it, i.e. after the next barrier if each step ends with wait(0) (UNROLL 1),
    # one barrier later if a wgmma may still be in flight there
    AHEAD: gl.constexpr = STAGES - 1 if UNROLL == 1 else STAGES - 2
    for i in gl.static_range(AHEAD):  # prologue: k-steps 0 .. AHEAD-1
        if i < NK:
            _issue_step(b_smem, w_smem, s_smem, b_ptrs, w_ptrs, s_ptrs, b_rows, i, i, KC, MASK_ROWS, TILED)
        async_copy.commit_group()

    acc = gl.zeros([BNW, BT], gl.float32, layout=mma)
    for run in range(NK // UNROLL):
        # UNROLL k-steps of straight-line code: each chunk's decode overlaps the previous chunk's
        # wgmma (wait(1)); the run ends with wait(0), so no wgmma is in flight across the back edge
        # (there ptxas may reuse the register operand while wgmma still reads it; see sass_check)
        for uu in gl.static_range(UNROLL):
            kk = run * UNROLL + uu
            slot = kk % STAGES
            async_copy.wait_group(AHEAD - 1)  # this thread's copies of k-step kk have landed
            hopper.fence_async_shared()  # ... and are visible to wgmma's (async proxy) reads
            _cta_barrier()  # everyone's are; the wgmmas of k-step kk+AHEAD-STAGES have retired
            nxt = kk + AHEAD
            if nxt < NK:  # refill the slot k-step kk+AHEAD-STAGES used
                _issue_step(
                    b_smem, w_smem, s_smem, b_ptrs, w_ptrs, s_ptrs, b_rows, nxt, nxt % STAGES, KC, MASK_ROWS, TILED
                )
            async_copy.commit_group()
            for ch in gl.static_range(KC):
                acc = _decode_and_mma(b_smem, w_smem, s_smem, slot * KC + ch, acc, BNW, CODES_LAYOUT)
                if uu * KC + ch == UNROLL * KC - 1:
                    acc = hopper.warpgroup_mma_wait(0, deps=[acc])
                else:
                    acc = hopper.warpgroup_mma_wait(1, deps=[acc])
    async_copy.wait_group(0)

    sa, sw = tile_scales(
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
    TILED: gl.constexpr,
    L2_AHEAD: gl.constexpr = 0,
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
    their path. L2_AHEAD: before waiting for a slot, ask L2 for the weight chunks L2_AHEAD chunks past the
    step's (within the tile; a tile's first L2_AHEAD with its first step): bytes in flight beyond the ring."""
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
    # a piece's rows from its first (a multiple of 16: the same base in either layout), chunk steps
    w_off = (
        weight_row_base(gl.arange(0, PIECE, layout=gl.SliceLayout(1, w_copy)), K // 2, 64, TILED)[:, None]
        + gl.arange(0, 64, layout=gl.SliceLayout(0, w_copy))[None, :]
    )
    s_off = (
        weight_row_base(gl.arange(0, PIECE, layout=gl.SliceLayout(1, s_copy)), K // 16, 8, TILED)[:, None]
        + gl.arange(0, 8, layout=gl.SliceLayout(0, s_copy))[None, :]
    )
    wait_then_release(PDL)
    n_tiles = N // BNW
    it = 0  # k-steps issued by this CTA so far: ring slot and phase
    for t in range(gl.program_id(0), gl.load(tmap_ptr + 3) * n_tiles, P):
        e, t0, row_end = tile_coords(tmap_ptr, t // n_tiles)
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
        for pc in gl.static_range(L2_AHEAD):
            l2_prefetch_chunk(w_ptr, ws_ptr, row0, pc, K, BNW, 32 * LW, TILED)
        for j in range(K // (128 * KC)):
            slot = it % STAGES
            if L2_AHEAD:
                for ch in gl.static_range(KC):
                    l2_prefetch_chunk(w_ptr, ws_ptr, row0, j * KC + ch + L2_AHEAD, K, BNW, 32 * LW, TILED)
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
                    async_copy.async_copy_global_to_shared(
                        w_dst, (w_ptr + prow * (K // 2) + weight_chunk_offset(c, 64, TILED)) + w_off
                    )
                    async_copy.async_copy_global_to_shared(
                        s_dst, (ws_ptr + prow * (K // 16) + weight_chunk_offset(c, 8, TILED)) + s_off
                    )
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
        sa, sw = tile_scales(
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
    this CTA's tiles by _ws_tile. NARROW: a tile whose expert has at most BT / 2 rows left runs half-width
    wgmmas (the slot's first BT / 2 activation rows; the rest are padding) and a half-width epilogue.
    OVERLAP needs registers for two decoded chunks (with too few, ptxas serializes every wgmma). y_desc
    (not None): tiles leave by TMA bulk stores (_store_tile_tma), the last one waited for before the
    partition ends."""
    wait_then_release(PDL)
    n_tiles = N // CTA_ROWS  # N tiles of the CTA's weight rows (all consumer partitions)
    it = 0  # k-steps consumed by this CTA so far
    for t in range(gl.program_id(0), gl.load(tmap_ptr + 3) * n_tiles, P):
        e, t0, row_end = tile_coords(tmap_ptr, t // n_tiles)
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
def w4a4_wgmma_ws_kernel(
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
    TILED: gl.constexpr = False,
    L2_AHEAD: gl.constexpr = 0,
):
    """Warp-specialized variant of w4a4_wgmma_kernel (KC 128-K chunks per ring slot, 1-step runs): LW
    loader warps fill the ring by cp.async and per-slot mbarriers, the NW consumer warps only decode and
    issue wgmma; no CTA-wide barrier. Triton puts a partition-wide barrier before every mbarrier wait,
    so one consumer partition's warpgroups move in step; SPLIT (NW 8 or 12) makes each warpgroup its own
    partition (CONSUMER_REGS: the second and third ones' registers), which then runs ahead of the others as
    far as the ring allows; NW 12 (192 weight rows per CTA, copied in 64-row pieces into 256-row buffers)
    needs it. MASK_ROWS: activation rows past the expert are zero-filled, not read. NARROW:
    tiles with at most BT / 2 rows left run half-width wgmmas (see _ws_consumer). Tiles (row
    tile, N tile; N fastest) t = program_id, program_id + P, ...: P = the grid, one tile per CTA when it
    covers them all, else persistent CTAs whose ring runs on from one tile into the next. STAGED
    (persistent CTAs): the loader stages each tile's S_dec_a in shared memory for the consumers' epilogue,
    so that its dependent loads (row -> token -> scale) do not stall the consumers at every tile's end;
    one tile per CTA loads them in the epilogue. y_desc (SPLIT; None: plain stores): a TMA descriptor of
    y in [BT, 64] boxes; each consumer warpgroup stages its output in a shared [BT, 64] buffer
    (_store_tile_tma)."""
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
                              ready, empty, N, P, K, HAS_AROWS, A_I64, BT, BNW, LW, MASK_ROWS, STAGED, PDL, TILED,
                              L2_AHEAD)),
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
                              ready, empty, N, P, K, HAS_AROWS, A_I64, BT, BNW, LW, MASK_ROWS, STAGED, PDL, TILED,
                              L2_AHEAD)),
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
                              ready, empty, N, P, K, HAS_AROWS, A_I64, BT, BNW, LW, MASK_ROWS, STAGED, PDL, TILED,
                              L2_AHEAD)),
            ],
            [LW],
            [LOADER_REGS],
        )  # fmt: skip
