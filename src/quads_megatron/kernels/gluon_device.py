"""Gluon device functions shared by the Gluon GEMMs (gemm_wgmma, gemm_mma): the programmatic-dependent-launch
prologue, a tile's coordinates and epilogue scales, a weight row's address in either layout
(weight_layout), an L2 prefetch of weight chunks, and the FP4 weight decode into an MMA's register A operand.

The A fragment of wgmma (per warp) and of mma.sync m16n8k16 is the same: lane 4g + t holds rows g and g+8
and k slots 2t, 2t+1, 2t+8, 2t+9 of each k16. A thread that holds 16 contiguous code bytes of rows g and
g+8 (bytes 16t..16t+15 of a 128-element chunk: two scale blocks) decodes them into exactly those registers
once K inside the chunk is permuted: element (code byte 16t + 4w + q, q = 2 q1 + q0, nibble s) goes to
slot (w1 w0 s q1 t1 t0 q0), which is DECODE_PERM applied to the decoded [n, t1, t0, w1, w0, q1, q0, s]. The
activation operand must meet each weight in the same slot (act_quant's "wgmma" order, or gemm_mma's view
of the "pairs" order).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from quads_megatron.kernels.fp4_device import PTX_HI, PTX_LO
from quads_megatron.kernels.weight_layout import CHUNK_K

_CHUNK = gl.constexpr(CHUNK_K)  # K elements per weight chunk

#: [n, t1, t0, w1, w0, q1, q0, s] -> [n, w1, w0, s, q1, t1, t0, q0]: the decoded weights' K order
DECODE_PERM = gl.constexpr((0, 3, 4, 7, 5, 1, 2, 6))


@gluon.jit
def wait_then_release(PDL: gl.constexpr):
    """pdl.wait_then_release for Gluon: wait for the previous kernel's writes, then let the next one launch."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def decode_weights(c, sc, BNW: gl.constexpr, A_LAYOUT: gl.constexpr):
    """Code bytes u8 [BNW, 8, 8] and scale bytes u8 [BNW, 8] of one 128-K chunk -> fp16 [BNW, 128]
    value * s_b * 2^-7 (exact) in the MMA's register A layout A_LAYOUT, K in DECODE_PERM's order (no
    data movement: asserted at compile time)."""
    s16 = gl.expand_dims(sc.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 128.0, 2)
    lo = gl.inline_asm_elementwise(PTX_LO, "=r,=r,r", [c], dtype=gl.float16, is_pure=True, pack=4) * s16
    hi = gl.inline_asm_elementwise(PTX_HI, "=r,=r,r", [c], dtype=gl.float16, is_pure=True, pack=4) * s16
    v = gl.reshape(gl.join(lo, hi), [BNW, 2, 2, 2, 2, 2, 2, 2])  # n, t1, t0, w1, w0, q1, q0, s
    v = gl.reshape(gl.permute(v, DECODE_PERM.value), [BNW, 128])  # n, w1, w0, s, q1, t1, t0, q0
    return gl.convert_layout(v, A_LAYOUT, assert_trivial=True)


@gluon.jit
def tile_coords(tmap_ptr, pid):
    """Row tile pid -> (expert e, first grouped row t0, end of e's rows) from tile_map, one round trip;
    e = -1 past the last tile."""
    return gl.load(tmap_ptr + pid * 4), gl.load(tmap_ptr + pid * 4 + 1), gl.load(tmap_ptr + pid * 4 + 2)


@gluon.jit
def weight_row_base(row, ROW_UNITS: gl.constexpr, CHUNK_UNITS: gl.constexpr, TILED: gl.constexpr):
    """Offset (in the tensor's units) of weight row `row`'s first chunk: row * ROW_UNITS in the row-major
    layout; in weight_layout's tiled one, its 16-row group's blocks (ROW_UNITS / CHUNK_UNITS chunks of 16 x
    CHUNK_UNITS) then its place in the block. Chunk c of the row is weight_chunk_offset(c, ...) further."""
    if TILED:
        return (row // 16) * (16 * ROW_UNITS) + (row % 16) * CHUNK_UNITS
    return row * ROW_UNITS


@gluon.jit
def weight_chunk_offset(c, CHUNK_UNITS: gl.constexpr, TILED: gl.constexpr):
    """Offset of a weight row's chunk c from its first (weight_row_base): chunks are CHUNK_UNITS apart in the
    row-major layout, one 16-row block (16 x CHUNK_UNITS) apart in the tiled one."""
    if TILED:
        return c * (16 * CHUNK_UNITS)
    return c * CHUNK_UNITS


@gluon.jit
def l2_prefetch_chunk(
    w_ptr, ws_ptr, row0, c, K: gl.constexpr, ROWS: gl.constexpr, THREADS: gl.constexpr, TILED: gl.constexpr
):
    """Ask L2 for 128-K chunk c (clamped to the last) of weight rows row0 .. row0 + ROWS (row0 a multiple of 16)
    by PTX prefetch.global.L2, spread over the THREADS threads calling it: tiled, each 16-row group's chunk is
    one 1 KB block of codes (8 lines) and one 128-byte line of scales; row-major, 64 code bytes and 8 scale
    bytes per row. Bytes in flight that hold no register or shared memory until their load."""
    c = gl.minimum(c, K // _CHUNK - 1)
    row0 = row0.to(gl.int64)
    th: gl.constexpr = gl.BlockedLayout([1], [32], [THREADS // 32], [0])
    LINES: gl.constexpr = ROWS // 2 if TILED else ROWS  # 128-byte code lines (tiled) or rows
    for rep in gl.static_range((LINES + THREADS - 1) // THREADS):
        i = (gl.arange(0, THREADS, layout=th) + rep * THREADS) % LINES  # threads past LINES repeat a line
        if TILED:
            row = row0 + (i // 8) * 16
            code = weight_row_base(row, K // 2, 64, True) + weight_chunk_offset(c, 64, True) + (i % 8) * 128
            scale = weight_row_base(row, K // 16, 8, True) + weight_chunk_offset(c, 8, True)
        else:
            row = row0 + i
            code = row * (K // 2) + c * 64
            scale = row * (K // 16) + c * 8
        gl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; prefetch.global.L2 [$2]; // $0",
            "=r,l,l",
            [w_ptr + code, ws_ptr + scale],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )


@gluon.jit
def tile_scales(
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
