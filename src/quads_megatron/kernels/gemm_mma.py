"""Decode-size grouped W4A4 GEMM in Gluon (sm_89+): registers only, no shared memory, no barriers.

The product is computed transposed, y^T[n, row] = W_e[n, :] . A[row, :], on mma.sync m16n8k16: the
decoded weights are the A operand (16 weight rows per instruction), the few token rows of an expert
at decode sizes its N (8 per instruction). Each thread loads its operands from global memory straight
into the registers mma.sync reads: 16 contiguous code bytes (two scale blocks) of weight rows g and
g+8 of its warp's 16 rows (lane = 4g + t, bytes 16t..16t+15 of a 128-element chunk), and, for token
row g, the same 32 elements of the "pairs" activation operand (16 even, 16 odd: two 32-byte pieces).
Which register meets which k slot is a permutation of K inside each chunk, the same for both
operands (gluon_device.decode_weights' order), so nothing moves between threads. A k-step
covers KC chunks (unrolled: ptxas issues their loads ahead of the decode); prefetch tiles instead load
the next chunk before decoding this one (a register pipeline, the codes carried as int32 words, since
loop-carried bytes are one register each); weights_first tiles issue every chunk's code loads of a step
before its first decode (ptxas otherwise keeps about one chunk ahead). The weights may be row-major or tiled
(weight_layout.tile_weights: each 16-row group's chunk one contiguous block). Every CTA reads its tile
from a row-tile table (row_tiles.RowTiles); persistent CTAs (PERSIST) loop over the live tiles instead of one
CTA per possible tile. L2_AHEAD: each K loop asks L2 for the weight chunks that many ahead (a persistent
CTA's run on into its next tile's), bytes in flight that hold no register.

Why: at decode an expert has 1-8 rows, so the GEMM is a stream of FP4 bytes through the decode. This
kernel issues 2.3-2.7 instructions per weight against 3.6 for the Triton and Gluon wgmma GEMMs; on the
H100 that took fc2 at 16 tokens from 37.9 to 33.7 us but fc1 only from 65.7 to 64.1: the weight stream is
bound by memory latency (bytes in flight, access pattern) more than by issue (docs/kernel-notes.md, v24).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from quads_megatron.kernels.gluon_device import (
    decode_weights,
    l2_prefetch_chunk,
    tile_coords,
    tile_scales,
    wait_then_release,
    weight_chunk_offset,
    weight_row_base,
)
from quads_megatron.kernels.weight_layout import CHUNK_K

CHUNK = gl.constexpr(CHUNK_K)  # K elements per chunk (64 code bytes per weight row, 16 per thread)
# The activations [row, s, t1, t0, w1, w0, q1, q0] of a chunk of the "pairs" operand (pair 16t + 4w + q of half
# s) into the k slots (w1 w0 s q1 t1 t0 q0, row last) where gluon_device.decode_weights puts the weight element
# they multiply (code byte 16t + 4w + q, nibble s): mma.sync's B fragment of lane 4g + t, row g.
X_PERM = gl.constexpr((4, 5, 1, 6, 2, 3, 7, 0))


def _weight_rows_layout(num_warps: int, row_groups: int, inner: list, lanes: list, shape: list):
    """A layout of [rows, ...] per-row data of the weight operand: inner register and t-lane bases over the
    trailing dims, then row g+8 in a register, lanes 4g + t over rows 0..7, warp w over rows 16w.., row
    groups every 16 * num_warps rows (mma.sync's A operand, row_groups repeats in registers)."""
    rows = 16 * num_warps
    regs = inner + [[8, 0, 0]] + [[rows << i, 0, 0] for i in range(row_groups.bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=lanes + [[1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << i, 0, 0] for i in range(num_warps.bit_length() - 1)],
        block_bases=[],
        shape=[rows * row_groups, *shape],
    )


def codes_layout(num_warps: int, row_groups: int) -> gl.DistributedLinearLayout:
    """Code bytes of one chunk as [rows, 8 scale blocks, 8 bytes]: a thread holds 16 contiguous bytes (two
    blocks) of rows g and g+8 of each of its warp's 16-row groups (lane = 4g + t, bytes 16t..16t+15)."""
    inner = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0]]
    return _weight_rows_layout(num_warps, row_groups, inner, [[0, 2, 0], [0, 4, 0]], [8, 8])


def codes16_layout(num_warps: int, row_groups: int) -> gl.DistributedLinearLayout:
    """codes_layout as loaded, [rows, 4 (t), 16 bytes]: each thread's 16 bytes of a row one access."""
    inner = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]]
    return _weight_rows_layout(num_warps, row_groups, inner, [[0, 1, 0], [0, 2, 0]], [4, 16])


def words_layout(num_warps: int, row_groups: int) -> gl.DistributedLinearLayout:
    """codes16_layout as 4-byte words, [rows, 4 (t), 4 words]."""
    return _weight_rows_layout(num_warps, row_groups, [[0, 0, 1], [0, 0, 2]], [[0, 1, 0], [0, 2, 0]], [4, 4])


def activation_layout(num_warps: int, block_t: int) -> gl.DistributedLinearLayout:
    """One chunk of the "pairs" operand as [rows, 2 (even | odd), 64 pairs]: a thread holds pairs
    16t..16t+15 of both halves of token row g (and g+8 with 16 rows); every warp holds all rows."""
    regs = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0]]
    regs += [[8 << i, 0, 0] for i in range((block_t // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[0, 0, 16], [0, 0, 32], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[0, 0, 0] for _ in range(num_warps.bit_length() - 1)],
        block_bases=[],
        shape=[block_t, 2, 64],
    )


@gluon.jit
def _activations(x, BT: gl.constexpr, B_LAYOUT: gl.constexpr):
    """One chunk of the pairs operand, fp16 [BT, 2, 64] (pair p = 16t + 4w + q, half s) -> [128, BT] in
    mma's B layout, K in decode_weights' order (no data movement: asserted)."""
    v = gl.reshape(x, [BT, 2, 2, 2, 2, 2, 2, 2])  # row, s, t1, t0, w1, w0, q1, q0
    v = gl.reshape(gl.permute(v, X_PERM.value), [128, BT])  # w1, w0, s, q1, t1, t0, q0, row
    return gl.convert_layout(v, B_LAYOUT, assert_trivial=True)


@gluon.jit
def _bytes(w):
    """int32 words [BN, 4, 4] -> their bytes u8 [BN, 4, 16], little-endian."""
    b0 = (w & 255).to(gl.uint8)
    b1 = ((w >> 8) & 255).to(gl.uint8)
    b2 = ((w >> 16) & 255).to(gl.uint8)
    b3 = ((w >> 24) & 255).to(gl.uint8)
    v = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [BN, 4, 4, b0|b2, (b0|b2)|(b1|b3)]: byte j at 2 (j // 2) + j % 2
    return gl.reshape(v, [w.shape[0], 4, 16])


@gluon.jit
def _word_op(a, b, OP: gl.constexpr):
    """a OP b on u8 tensors, four bytes per 32-bit instruction (PTX xor / and / or .b32)."""
    return gl.inline_asm_elementwise(OP + ".b32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.uint8, is_pure=True, pack=4)


@gluon.jit
def _l2_ahead(w_ptr, ws_ptr, row0, next_row0, c, K: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr,
              TILED: gl.constexpr):  # fmt: skip
    """l2_prefetch_chunk of chunk c of this tile's weight rows (row0 ..), or, where c runs past the row's last
    chunk and a next tile exists (next_row0 >= 0: a persistent CTA's next tile), chunk c - K / 128 of the next
    tile's rows: the stream of prefetches runs on from one tile into the next."""
    past = (c >= K // CHUNK) & (next_row0 >= 0)
    row = gl.where(past, next_row0, row0)
    l2_prefetch_chunk(w_ptr, ws_ptr, row, gl.where(past, c - K // CHUNK, c), K, BN, 32 * NW, TILED)


@gluon.jit
def _mma_tile(
    e,
    t0,
    row_end,
    n0,
    next_row0,
    a_ptr,
    asdec_ptr,
    w_ptr,
    ws_ptr,
    wsdec_ptr,
    arows_ptr,
    y_ptr,
    N,
    wsdec_stride,
    K: gl.constexpr,
    HAS_AROWS: gl.constexpr,
    BT: gl.constexpr,
    NW: gl.constexpr,
    RG: gl.constexpr,
    KC: gl.constexpr,
    CODES_LAYOUT: gl.constexpr,
    X_LAYOUT: gl.constexpr,
    C16_LAYOUT: gl.constexpr,
    PREFETCH: gl.constexpr,
    WEIGHT_LOADS: gl.constexpr,
    WORDS_LAYOUT: gl.constexpr,
    TILED: gl.constexpr,
    WEIGHTS_FIRST: gl.constexpr,
    L2_AHEAD: gl.constexpr,
):
    """One CTA's tile: weight rows n0 .. n0 + 16 NW RG of expert e against its grouped rows t0 .. t0 + BT
    (those past row_end masked), the whole K. next_row0: the first weight row (e * N + n0) of the CTA's next
    tile, -1 for none, where L2 prefetches past this tile's last chunk go."""
    BN: gl.constexpr = 16 * NW * RG  # weight rows per CTA
    NK: gl.constexpr = K // (CHUNK * KC)  # k-steps of KC chunks
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    cl: gl.constexpr = C16_LAYOUT  # the code bytes as loaded, [BN, 4, 16]
    xl: gl.constexpr = X_LAYOUT  # activation_layout(NW, BT)

    # per thread: 16 contiguous code bytes of each of its rows ([BN, 4, 16] loads, one 16-byte access each),
    # their 2 scale bytes, and 16 + 16 pairs of each of its token rows
    cr = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, cl)))
    ct = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, cl)))
    cq = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, cl)))
    # TILED (weight_layout.tile_weights): each 16-row group's chunk is one 1 KB block of codes (a warp's
    # 16-byte loads read 512 contiguous bytes) and one 128-byte block of scales; else rows of K / 2 bytes
    wrow = (e * N + n0 + cr).to(gl.int64)
    c_ptrs = (
        w_ptr + weight_row_base(wrow, K // 2, 64, TILED)[:, None, None] + (ct * 16)[None, :, None] + cq[None, None, :]
    )
    sl: gl.constexpr = gl.SliceLayout(2, CODES_LAYOUT)
    sr = gl.arange(0, BN, layout=gl.SliceLayout(1, sl))
    sb = gl.arange(0, 8, layout=gl.SliceLayout(0, sl))
    s_ptrs = ws_ptr + weight_row_base((e * N + n0 + sr).to(gl.int64), K // 16, 8, TILED)[:, None] + sb[None, :]
    xr = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl)))
    xs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, xl)))
    xp = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl)))
    xr = gl.where(xr < row_end, xr, t0)  # rows past the expert read its first row: columns never stored
    if HAS_AROWS:
        tok = gl.load(arows_ptr + xr).to(gl.int64)
    else:
        tok = xr.to(gl.int64)
    x_ptrs = a_ptr + (tok * K)[:, None, None] + (xs * (K // 2))[None, :, None] + xp[None, None, :]

    # weight bytes are read once: WEIGHT_LOADS "cg" bypasses L1, "evict_first" marks them first out of it, which
    # leaves it to the activations every warp and every CTA of the expert re-reads
    W_CACHE: gl.constexpr = ".cg" if WEIGHT_LOADS == "cg" else ""
    W_EVICT: gl.constexpr = "evict_first" if WEIGHT_LOADS == "evict_first" else ""
    acc = gl.zeros([BN, BT], gl.float32, layout=mma)
    for pc in gl.static_range(L2_AHEAD):  # the first chunks' requests to L2; the K loop keeps L2_AHEAD ahead
        l2_prefetch_chunk(w_ptr, ws_ptr, e * N + n0, pc, K, BN, 32 * NW, TILED)
    if PREFETCH:  # the next chunk's loads in flight under this one's decode; codes carried as int32 words
        wl: gl.constexpr = WORDS_LAYOUT
        wr2 = (e * N + n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, wl)))).to(gl.int64)
        wt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, wl)))
        ww = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
        w32 = w_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        cw_ptrs = (
            w32 + weight_row_base(wr2, K // 8, 16, TILED)[:, None, None] + (wt * 4)[None, :, None] + ww[None, None, :]
        )
        cw = gl.load(cw_ptrs, cache_modifier=W_CACHE, eviction_policy=W_EVICT)
        s = gl.load(s_ptrs, cache_modifier=W_CACHE, eviction_policy=W_EVICT)
        x = gl.load(x_ptrs)
        for j in range(NK * KC):
            if L2_AHEAD:
                _l2_ahead(w_ptr, ws_ptr, e * N + n0, next_row0, j + L2_AHEAD, K, BN, NW, TILED)
            nj = gl.minimum(j + 1, NK * KC - 1)  # the last chunk reloads itself
            cw_n = gl.load(
                cw_ptrs + weight_chunk_offset(nj, 16, TILED), cache_modifier=W_CACHE, eviction_policy=W_EVICT
            )
            s_n = gl.load(s_ptrs + weight_chunk_offset(nj, 8, TILED), cache_modifier=W_CACHE, eviction_policy=W_EVICT)
            x_n = gl.load(x_ptrs + nj * 64)
            c16 = gl.convert_layout(_bytes(cw), C16_LAYOUT, assert_trivial=True)
            c = gl.convert_layout(gl.reshape(c16, [BN, 8, 8]), CODES_LAYOUT, assert_trivial=True)
            acc = mma_v2(decode_weights(c, s, BN, a_layout), _activations(x, BT, b_layout), acc)
            cw = cw_n
            s = s_n
            x = x_n
    elif WEIGHTS_FIRST:  # every chunk's code loads of the step issued before the step's first decode
        gate = gl.full([BN, 4, 16], 0, gl.uint8, layout=cl) | (e >> 30).to(gl.uint8)  # 0, unknown to ptxas
        for j in range(NK):
            if L2_AHEAD:
                for ch in gl.static_range(KC):
                    _l2_ahead(w_ptr, ws_ptr, e * N + n0, next_row0, j * KC + ch + L2_AHEAD, K, BN, NW, TILED)
            cs = ()
            mix = gate
            for ch in gl.static_range(KC):
                c_ch = gl.load(
                    c_ptrs + weight_chunk_offset(j * KC + ch, 64, TILED),
                    cache_modifier=W_CACHE,
                    eviction_policy=W_EVICT,
                )
                cs = cs + (c_ch,)
                mix = _word_op(mix, c_ch, "xor")
            mix = _word_op(mix, gate, "and")  # zero, yet each decode below depends on every chunk's load
            for ch in gl.static_range(KC):
                cc = j * KC + ch
                c = gl.reshape(_word_op(cs[ch], mix, "or"), [BN, 8, 8])
                c = gl.convert_layout(c, CODES_LAYOUT, assert_trivial=True)
                s = gl.load(s_ptrs + weight_chunk_offset(cc, 8, TILED), cache_modifier=W_CACHE, eviction_policy=W_EVICT)
                x = gl.load(x_ptrs + cc * 64)
                acc = mma_v2(decode_weights(c, s, BN, a_layout), _activations(x, BT, b_layout), acc)
    else:
        for j in range(NK):
            if L2_AHEAD:
                for ch in gl.static_range(KC):
                    _l2_ahead(w_ptr, ws_ptr, e * N + n0, next_row0, j * KC + ch + L2_AHEAD, K, BN, NW, TILED)
            for ch in gl.static_range(KC):  # unrolled: the step's loads are issued ahead of its decodes
                cc = j * KC + ch
                c = gl.load(
                    c_ptrs + weight_chunk_offset(cc, 64, TILED), cache_modifier=W_CACHE, eviction_policy=W_EVICT
                )
                c = gl.convert_layout(gl.reshape(c, [BN, 8, 8]), CODES_LAYOUT, assert_trivial=True)
                s = gl.load(s_ptrs + weight_chunk_offset(cc, 8, TILED), cache_modifier=W_CACHE, eviction_policy=W_EVICT)
                x = gl.load(x_ptrs + cc * 64)
                acc = mma_v2(decode_weights(c, s, BN, a_layout), _activations(x, BT, b_layout), acc)

    # epilogue: y[t0 + col, n0 + row] = acc * 2^14 * S_dec_a[token] * S_dec_w[e], rows past the expert masked
    orow = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    ocol = t0 + gl.arange(0, BT, layout=gl.SliceLayout(0, mma))
    omask = ocol < row_end
    sa, sw = tile_scales(
        arows_ptr, asdec_ptr, wsdec_ptr, e, t0, row_end, wsdec_stride, HAS_AROWS, BT, gl.SliceLayout(0, mma)
    )
    y = ((acc * 16384.0) * sa[None, :] * sw).to(y_ptr.dtype.element_ty)
    gl.store(y_ptr + ocol.to(gl.int64)[None, :] * N + orow[:, None], y, mask=omask[None, :])


@gluon.jit
def w4a4_mma_kernel(
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
    P,
    K: gl.constexpr,
    HAS_AROWS: gl.constexpr,
    BT: gl.constexpr,
    NW: gl.constexpr,
    RG: gl.constexpr,
    KC: gl.constexpr,
    CODES_LAYOUT: gl.constexpr,
    X_LAYOUT: gl.constexpr,
    C16_LAYOUT: gl.constexpr,
    PREFETCH: gl.constexpr,
    WEIGHT_LOADS: gl.constexpr,
    WORDS_LAYOUT: gl.constexpr,
    PDL: gl.constexpr,
    TILED: gl.constexpr = False,
    WEIGHTS_FIRST: gl.constexpr = False,
    L2_AHEAD: gl.constexpr = 0,
    PERSIST: gl.constexpr = False,
):
    """Tiles (row tile, N tile): program (N tile, row tile), N tiles fastest (a row tile's activations are
    re-read from L2, not HBM); PERSIST: P CTAs (grid (P,)) loop over tiles t = program, program + P, ...
    (N tile t % (N / BN) of row tile t // (N / BN)), no CTA for a row tile past the last."""
    wait_then_release(PDL)
    BN: gl.constexpr = 16 * NW * RG  # weight rows per CTA
    if PERSIST:
        n_tiles = N // BN
        limit = gl.load(tmap_ptr + 3) * n_tiles
        for t in range(gl.program_id(0), limit, P):
            e, t0, row_end = tile_coords(tmap_ptr, t // n_tiles)
            next_row0 = -1
            if L2_AHEAD:  # the next tile's rows, for the prefetches past this one's last chunk
                nt = t + P
                ne = gl.load(tmap_ptr + (nt // n_tiles) * 4, mask=nt < limit, other=-1)
                next_row0 = gl.where(ne >= 0, ne * N + (nt % n_tiles) * BN, -1)
            _mma_tile(
                e, t0, row_end, (t % n_tiles) * BN, next_row0, a_ptr, asdec_ptr, w_ptr, ws_ptr, wsdec_ptr,
                arows_ptr, y_ptr, N, wsdec_stride, K, HAS_AROWS, BT, NW, RG, KC, CODES_LAYOUT, X_LAYOUT,
                C16_LAYOUT, PREFETCH, WEIGHT_LOADS, WORDS_LAYOUT, TILED, WEIGHTS_FIRST, L2_AHEAD,
            )  # fmt: skip
    else:
        e, t0, row_end = tile_coords(tmap_ptr, gl.program_id(1))
        if e >= 0:
            _mma_tile(
                e, t0, row_end, gl.program_id(0) * BN, -1, a_ptr, asdec_ptr, w_ptr, ws_ptr, wsdec_ptr,
                arows_ptr, y_ptr, N, wsdec_stride, K, HAS_AROWS, BT, NW, RG, KC, CODES_LAYOUT, X_LAYOUT,
                C16_LAYOUT, PREFETCH, WEIGHT_LOADS, WORDS_LAYOUT, TILED, WEIGHTS_FIRST, L2_AHEAD,
            )  # fmt: skip
