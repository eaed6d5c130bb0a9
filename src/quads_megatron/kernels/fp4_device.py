"""Triton device functions for NVFP4 (E2M1 elements, E4M3 block scales) shared by the kernels.

Encoding (quantize twin, activation quantization): exact fp32/int arithmetic rather than float8 casts,
because Triton's interpreter rounds fp32 -> float8e4nv wrongly at binade boundaries, so the same code
is bit-identical to quads_megatron.nvfp4 on the GPU and under TRITON_INTERPRET=1.
Decoding (the GEMMs): FP4 codes become fp16 value * 2^-14 by bit operations (PTX on the GPU, see
nibble_ptx), scaled by the E4M3 block scale times 2^7; every product is exact in fp16.
"""

from __future__ import annotations

import triton
import triton.language as tl

# globals read inside @triton.jit functions must be tl.constexpr
FP32_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH_FP32 = tl.constexpr(0.16666667163372040)  # fp32(1/6), as TE folds it into the global multiplier


# ----------------------------------------------------------------------------- encoding


@triton.jit
def e4m3_rne(v):
    """v: fp32 in [0, 448] -> (value as fp32, E4M3 code as int32), round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) - 127, -6)  # binade, subnormals share the 2^-6 binade
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)  # 2^(e+20): ulp = 2^(e-3)
    r = (v + magic) - magic
    rb = r.to(tl.int32, bitcast=True)
    normal_code = (((rb >> 23) - 127 + 7) << 3) | ((rb >> 20) & 7)
    sub_code = (r * 512.0).to(tl.int32)
    return r, tl.where(r >= 0.015625, normal_code, sub_code)


@triton.jit
def e2m1_code(v):
    """v: fp32 already clamped to [-6, 6] -> E2M1 code (int32, 0..15), RNE with ties to even."""
    a = tl.abs(v)
    idx = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return idx | tl.where(v < 0.0, 8, 0)


@triton.jit
def e2m1_round(v):
    """v: fp32 already clamped to [-6, 6] -> its E2M1 value (RNE, ties to even) as fp32, the value of
    e2m1_code(v) without the code: one add and subtract of 2^(22 + binade) (ulp 0.5 below 2, 1 below
    4, 2 up to 6, where the E2M1 grid is uniform and even codes are even multiples of the ulp)."""
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127, 0)  # 0: [0, 2), 1: [2, 4), 2: [4, 6]
    magic = ((e + 149) << 23).to(tl.float32, bitcast=True)  # 2^(e + 22)
    r = (a + magic) - magic
    return tl.where(v < 0.0, -r, r)


@triton.jit
def nvfp4_block_scaled(x0, x1, s_enc, s_dec, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block scales of even/odd elements x0, x1 [BLOCK_M, BLOCK_K/2] (fp32) with per-row S_enc/S_dec
    [BLOCK_M], and the elements in E2M1 range: (x0, x1 times 1 / (s_b * S_dec), clamped to [-6, 6],
    fp32 [BLOCK_M, BLOCK_K/2]; scale codes int32 and scale values fp32 [BLOCK_M, BLOCK_K/16])."""
    HALF: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 16
    a = tl.maximum(tl.abs(x0), tl.abs(x1))
    bmax = tl.max(tl.reshape(a, (BLOCK_M, NB, 8)), axis=2)
    mult = s_enc * ONE_SIXTH_FP32
    sb, sb_code = e4m3_rne(tl.minimum(bmax * mult[:, None], 448.0))
    enc = tl.minimum(tl.div_rn(tl.full(sb.shape, 1.0, tl.float32), sb * s_dec[:, None]), FP32_MAX)
    enc_full = tl.reshape(tl.broadcast_to(enc[:, :, None], (BLOCK_M, NB, 8)), (BLOCK_M, HALF))
    y0 = tl.minimum(tl.maximum(x0 * enc_full, -6.0), 6.0)
    y1 = tl.minimum(tl.maximum(x1 * enc_full, -6.0), 6.0)
    return y0, y1, sb_code, sb


@triton.jit
def nvfp4_block_encode(x0, x1, s_enc, s_dec, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Encode even/odd elements x0, x1 [BLOCK_M, BLOCK_K/2] (fp32) with per-row S_enc/S_dec [BLOCK_M].

    Returns (packed bytes int32 [BLOCK_M, BLOCK_K/2], scale codes int32 [BLOCK_M, BLOCK_K/16],
    scale values fp32 [BLOCK_M, BLOCK_K/16]).
    """
    y0, y1, sb_code, sb = nvfp4_block_scaled(x0, x1, s_enc, s_dec, BLOCK_M, BLOCK_K)
    return e2m1_code(y0) | (e2m1_code(y1) << 4), sb_code, sb


@triton.jit
def round_bf16(y):
    """fp32 -> the nearest-even bf16 value, still as fp32 (bit ops: the interpreter's own cast truncates)."""
    yb = y.to(tl.int32, bitcast=True)
    return ((yb + 0x7FFF + ((yb >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------- decoding


@triton.jit
def e2m1_value(c):
    """E2M1 code (int32 0..15) -> fp32 value."""
    idx = c & 7
    mag = tl.where(
        idx < 4,
        idx.to(tl.float32) * 0.5,
        tl.where(idx == 4, 2.0, tl.where(idx == 5, 3.0, tl.where(idx == 6, 4.0, 6.0))),
    )
    return tl.where(c >= 8, -mag, mag)


@triton.jit
def e4m3_value(s):
    """E4M3 byte (int32, non-negative finite) -> fp32 value."""
    e = (s >> 3) & 15
    m = s & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


def nibble_ptx(hi: bool) -> str:
    """PTX: 4 packed code bytes ($2) -> 4 fp16 (two half2 in $0, $1) of the low or high nibble of each byte.

    The fp16 of value * 2^-14 is (code & 7) << 9 | (code & 8) << 12: its low byte is zero, so the four
    high bytes are built in one register at once (magnitude to bits 1-3 and sign to bit 7 of every
    byte: shift, and, shift-or-lop3) and prmt spreads them over the two half2 with zero low bytes.
    5 instructions (high nibbles) or 6 (low) per 4 values.
    """
    if hi:  # bits 4-6 -> 1-3 (shift right 3); the sign is already bit 7
        mag, sign = "shr.b32 a, $2, 3;", "mov.b32 b, $2;"
    else:  # bits 0-2 -> 1-3 (shift left 1); sign bit 3 -> 7 (shift left 4)
        mag, sign = "shl.b32 a, $2, 1;", "shl.b32 b, $2, 4;"
    return (
        "{ .reg .b32 a, b, y, z; mov.b32 z, 0; "
        + mag
        + " and.b32 a, a, 0x0E0E0E0E; "
        + sign
        + " lop3.b32 y, b, 0x80808080, a, 0xEA; prmt.b32 $0, y, z, 0x1404; prmt.b32 $1, y, z, 0x3424; }"
    )


# the PTX of the low and high nibbles, as constexprs for Triton and Gluon kernels (gl.constexpr is tl.constexpr)
PTX_LO = tl.constexpr(nibble_ptx(False))
PTX_HI = tl.constexpr(nibble_ptx(True))


@triton.jit
def fp4_bits_to_fp16(c, HI: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed code bytes (uint8) -> fp16 value * 2^-14 of the low (HI=False) or high nibble.

    fp16 bits (code & 7) << 9 | (code & 8) << 12 are exactly value * 2^-14, subnormals included.
    USE_ASM (GPU): 4 bytes per PTX sequence (nibble_ptx); otherwise plain integer ops (also the
    interpreter's path, and the GPU twin the device checks compare bit for bit).
    """
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm=PTX_HI if HI else PTX_LO, constraints="=r,=r,r", args=[c], dtype=tl.float16, is_pure=True, pack=4
        )
    ci = c.to(tl.int32)
    if HI:
        bits = ((ci & 0x70) << 5) | ((ci & 0x80) << 8)
    else:
        bits = ((ci & 7) << 9) | ((ci & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def load_decoded(
    code_ptr,
    scale_ptr,
    rows64,
    rmask,
    k0,
    K: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """Rows of an NVFP4 matrix (codes [R, K/2], scale bytes [R, K/16]) for K columns [k0, k0+BK)
    -> (even, odd) fp16 tiles [BR, BK/2] holding value * s_b * 2^-7 (exact).

    value * 2^-14 (fp16 bits) times fp16(s_b * 2^7) has <= 6 significant bits in [2^-17, 21]:
    exact. Callers multiply dot results by 2^14. Rows outside rmask decode to 0.
    """
    p = k0 // 2 + tl.arange(0, BK // 2)
    b = k0 // 16 + tl.arange(0, BK // 16)
    c = tl.load(code_ptr + rows64[:, None] * (K // 2) + p[None, :], mask=rmask[:, None], other=0)
    sb = tl.load(scale_ptr + rows64[:, None] * (K // 16) + b[None, :], mask=rmask[:, None], other=0)
    if USE_ASM:  # hardware E4M3 -> fp16 (cvt f16x2.e4m3x2, exact; scale bytes are finite and >= 0)
        s16 = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 128.0
    else:
        s16 = (e4m3_value(sb.to(tl.int32)) * 128.0).to(tl.float16)
    s_full = tl.reshape(tl.broadcast_to(s16[:, :, None], (BR, BK // 16, 8)), (BR, BK // 2))
    lo = fp4_bits_to_fp16(c, False, USE_ASM) * s_full
    hi = fp4_bits_to_fp16(c, True, USE_ASM) * s_full
    return lo, hi
