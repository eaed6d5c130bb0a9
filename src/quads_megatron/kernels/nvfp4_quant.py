"""Triton NVFP4 quantize kernel, bit-identical to quads_megatron.nvfp4.quantize.

The global scale (amax, S_enc, S_dec) comes from the contract in torch; the kernel does the
per-block part (block amax, E4M3 block scale, element encode and packing) with the exact-arithmetic
encoders of fp4_device. A 4over6 recipe runs its own kernel (_quantize_4over6_kernel), so the plain
kernel's code is what it was. Runs on GPU, and on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads_megatron import nvfp4
from quads_megatron.kernels.fp4_device import e2m1_code, nvfp4_block_encode, nvfp4_block_scaled_4over6
from quads_megatron.nvfp4 import NVFP4Recipe, NVFP4Tensor, ScaleMode


@triton.jit
def _load_tile(x_ptr, s_enc_ptr, s_dec_ptr, M, K, stride_xm, s_stride, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_K] tile as even/odd fp32 halves, its indices, masks and row scales."""
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
    return rows, pairs, blocks, rmask, mask, x0, x1, s_enc, s_dec


@triton.jit
def _store_tile(codes_ptr, scales_ptr, packed, sb_code, rows, pairs, blocks, rmask, mask, K):
    """Packed E2M1 pairs [BLOCK_M, BLOCK_K/2] and E4M3 block-scale codes [BLOCK_M, BLOCK_K/16] of a tile."""
    out_rows = rows[:, None].to(tl.int64)
    tl.store(codes_ptr + out_rows * (K // 2) + pairs[None, :], packed.to(tl.uint8), mask=mask)
    smask = rmask[:, None] & (blocks[None, :] < K // 16)
    tl.store(scales_ptr + out_rows * (K // 16) + blocks[None, :], sb_code.to(tl.uint8), mask=smask)


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
    rows, pairs, blocks, rmask, mask, x0, x1, s_enc, s_dec = _load_tile(
        x_ptr, s_enc_ptr, s_dec_ptr, M, K, stride_xm, s_stride, BLOCK_M, BLOCK_K
    )
    packed, sb_code, _ = nvfp4_block_encode(x0, x1, s_enc, s_dec, BLOCK_M, BLOCK_K)
    _store_tile(codes_ptr, scales_ptr, packed, sb_code, rows, pairs, blocks, rmask, mask, K)


@triton.jit
def _quantize_4over6_kernel(
    x_ptr,
    s_enc_ptr,
    s_dec_ptr,
    amax_ptr,
    codes_ptr,
    scales_ptr,
    M,
    K,
    stride_xm,
    s_stride,
    E4M3_MAX: tl.constexpr,
    MSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_quantize_kernel under a 4over6 recipe: amax_ptr holds the global amax (per row with s_stride 1)."""
    rows, pairs, blocks, rmask, mask, x0, x1, s_enc, s_dec = _load_tile(
        x_ptr, s_enc_ptr, s_dec_ptr, M, K, stride_xm, s_stride, BLOCK_M, BLOCK_K
    )
    amax = tl.load(amax_ptr + rows * s_stride, mask=rmask, other=0.0)
    y0, y1, sb_code, _ = nvfp4_block_scaled_4over6(x0, x1, s_enc, s_dec, amax, E4M3_MAX, MSE, BLOCK_M, BLOCK_K)
    packed = e2m1_code(y0) | (e2m1_code(y1) << 4)
    _store_tile(codes_ptr, scales_ptr, packed, sb_code, rows, pairs, blocks, rmask, mask, K)


def quantize(
    x: torch.Tensor,
    scale_mode: ScaleMode = "tensor",
    global_amax: torch.Tensor | None = None,
    check: bool = True,
    block_m: int = 16,
    block_k: int = 128,
    recipe: NVFP4Recipe | None = None,
) -> NVFP4Tensor:
    """Triton twin of quads_megatron.nvfp4.quantize (same arguments, same bits; recipe: the variant)."""
    recipe = nvfp4._recipe(recipe)
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
    global_amax = global_amax.detach().float().to(x.device)
    s_enc = nvfp4.global_encode_scale(global_amax, recipe)
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
    if recipe.use_4over6:
        _quantize_4over6_kernel[grid](
            x2,
            s_enc_flat,
            s_dec_flat,
            global_amax.reshape(-1).contiguous(),
            codes,
            scales,
            m,
            k,
            x2.stride(0),
            s_stride,
            E4M3_MAX=float(recipe.e4m3_max),
            MSE=recipe.err_mode == "MSE",
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            enable_fp_fusion=False,  # the candidates' errors: rounded products and sums, as the torch contract
        )
    else:
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
