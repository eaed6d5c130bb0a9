"""Triton NVFP4 quantize kernel, bit-identical to quads_megatron.nvfp4.quantize.

The global scale (amax, S_enc, S_dec) comes from the contract in torch; the kernel does the
per-block part: block amax, E4M3 block scale, element encode and packing. Runs on GPU, and on
CPU under TRITON_INTERPRET=1.

E4M3 rounding is done with exact fp32/int arithmetic (not a float8 cast), because Triton's
interpreter rounds fp32->float8e4nv wrongly at binade boundaries (31.9 -> 16 seen with 3.6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads_megatron import nvfp4
from quads_megatron.nvfp4 import NVFP4Tensor, ScaleMode

# globals read inside @triton.jit functions must be tl.constexpr
FP32_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH_FP32 = tl.constexpr(0.16666667163372040)  # fp32(1/6), as TE folds it into the global multiplier


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
def _quantize_kernel(
    x_ptr,
    s_enc_ptr,
    s_dec_ptr,
    codes_ptr,
    scales_ptr,
    M,
    K,
    stride_xm,
    s_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.program_id(1) * HALF + tl.arange(0, HALF)
    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    rmask = rows < M
    mask = rmask[:, None] & (pairs[None, :] < K // 2)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + 2 * pairs[None, :]
    x0 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(ptrs + 1, mask=mask, other=0.0).to(tl.float32)
    s_enc = tl.load(s_enc_ptr + rows * s_stride, mask=rmask, other=1.0)
    s_dec = tl.load(s_dec_ptr + rows * s_stride, mask=rmask, other=1.0)
    packed, sb_code, _ = nvfp4_block_encode(x0, x1, s_enc, s_dec, BLOCK_M, BLOCK_K)
    out_rows = rows[:, None].to(tl.int64)
    tl.store(codes_ptr + out_rows * (K // 2) + pairs[None, :], packed.to(tl.uint8), mask=mask)
    smask = rmask[:, None] & (blocks[None, :] < K // 16)
    tl.store(scales_ptr + out_rows * (K // 16) + blocks[None, :], sb_code.to(tl.uint8), mask=smask)


def quantize(
    x: torch.Tensor,
    scale_mode: ScaleMode = "tensor",
    global_amax: torch.Tensor | None = None,
    check: bool = True,
    block_m: int = 16,
    block_k: int = 128,
) -> NVFP4Tensor:
    """Triton twin of quads_megatron.nvfp4.quantize (same arguments, same bits)."""
    if check:
        nvfp4.check_quantizable(x, "quantize input")
    if block_k % 16:
        raise ValueError(f"block_k must be a multiple of 16, got {block_k}")
    k = x.shape[-1]
    x2 = x.detach().reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if global_amax is None:
        global_amax = nvfp4.amax(x, scale_mode)
    s_enc = nvfp4.global_encode_scale(global_amax.detach().float().to(x.device))
    s_dec = torch.div(1.0, s_enc)
    if scale_mode == "tensor":
        if s_enc.numel() != 1:
            raise nvfp4.NVFP4InputError("per-tensor global_amax must have one element")
        s_stride = 0
    else:
        if s_enc.numel() != m:
            raise nvfp4.NVFP4InputError(f"per-row global_amax must have {m} elements, got {s_enc.numel()}")
        s_stride = 1
    s_enc_flat = s_enc.reshape(-1).contiguous()
    s_dec_flat = s_dec.reshape(-1).contiguous()
    codes = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, k // 16), dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    _quantize_kernel[grid](
        x2,
        s_enc_flat,
        s_dec_flat,
        codes,
        scales,
        m,
        k,
        x2.stride(0),
        s_stride,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
    )
    lead = x.shape[:-1]
    gshape = s_dec.reshape(()) if scale_mode == "tensor" else s_dec.reshape(*lead, 1)
    return NVFP4Tensor(
        codes=codes.reshape(*lead, k // 2),
        block_scales=scales.view(torch.float8_e4m3fn).reshape(*lead, k // 16),
        global_decode=gshape,
    )
