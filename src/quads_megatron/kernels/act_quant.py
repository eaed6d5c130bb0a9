"""Activation quantization for the W4A4 GEMMs, with RAC, in one Triton launch per GEMM.

x [M, K] -> per-token NVFP4 codes/scales and S_dec [M, 1], plus (RAC: a static plan or dynamic
per-token block selection) the dense residual's codes/scales, bit-identical to
quads_megatron.rollout.reference.quantize_activation (quantize_activation); or the GEMM's decoded
fp16 operand with the residual already folded in (activation_operand), optionally of SiLU(gate) * up
computed in the same pass (an MoE block's fc2). The same launch can also write a grouped GEMM's
row-tile table (row_tiles.RowTiles) with extra programs. Tiles: tile_configs.ActQuantConfig, tuned
defaults from configs/act_quant.json. recipe: the activations' NVFP4 variant (quads_megatron.nvfp4; 4over6
is a constexpr branch, so the plain kernels' code is what it was), for x and for its RAC residual.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quads_megatron import nvfp4
from quads_megatron.kernels import pdl
from quads_megatron.kernels.fp4_device import (
    FP32_MAX,
    e2m1_round,
    e2m1_value,
    nvfp4_block_encode_recipe,
    nvfp4_block_scaled_recipe,
    round_bf16,
)
from quads_megatron.kernels.pdl import wait_then_release
from quads_megatron.kernels.route import Routing, route_launch, route_program
from quads_megatron.kernels.row_tiles import RowTiles, tile_map_chunk
from quads_megatron.kernels.tile_configs import ActQuantConfig, act_quant_config
from quads_megatron.nvfp4 import NVFP4Recipe, NVFP4Tensor
from quads_megatron.rollout.rac_plan import QuantizedActivation, RACPlan, check_rac_selection


@triton.jit
def _block_scores(d0, d1, k0, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_K/16]: each block's residual amax max|d| (d = x - v * S_dec, even/odd; rollout.
    reference's dynamic_block_mask scores) of columns [k0, k0 + BLOCK_K); 0 for padding blocks: never strictly
    larger than a real block's (>= 0), so they never count."""
    NB: tl.constexpr = BLOCK_K // 16
    blocks = k0 // 16 + tl.arange(0, NB)
    score = tl.max(tl.reshape(tl.maximum(tl.abs(d0), tl.abs(d1)), (BLOCK_M, NB, 8)), axis=2)
    return tl.where(blocks[None, :] < K // 16, score, 0.0)


@triton.jit
def _larger_count(score, other):
    """int32 [BLOCK_M, NA]: per block of score [BLOCK_M, NA], how many blocks of other [BLOCK_M, NO] are
    strictly larger (one all-pairs compare)."""
    d = score.to(tl.int32, bitcast=True)[:, :, None] - other.to(tl.int32, bitcast=True)[:, None, :]
    return tl.sum((d.to(tl.uint32, bitcast=True) >> 31).to(tl.int32, bitcast=True), axis=2)


@triton.jit
def _at_least(score, t):
    """int32 [BLOCK_M]: how many blocks of score [BLOCK_M, NB] (fp32 bit patterns) are >= t [BLOCK_M]."""
    return tl.sum((score >= t[:, None]).to(tl.int32), axis=1)


@triton.jit
def _bisect_threshold(bits_a, bits_b, n_sel, BLOCK_M: tl.constexpr, TWO: tl.constexpr):
    """int32 [BLOCK_M]: the largest t with count(score >= t) >= n_sel over the blocks of bits_a (and, TWO,
    bits_b), by bisection on the fp32 bit patterns (monotonic for non-negative floats): 31 row reductions,
    but no NB x NB tile in registers."""
    lo = tl.zeros((BLOCK_M,), tl.int32)
    hi = tl.full((BLOCK_M,), 0x7F800000, tl.int32)
    for _ in tl.static_range(31):
        mid = lo + (hi - lo + 1) // 2
        n = _at_least(bits_a, mid)
        if TWO:
            n += _at_least(bits_b, mid)
        ok = n >= n_sel
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _dynamic_selection(score, n_sel, BLOCK_M: tl.constexpr, NB: tl.constexpr):
    """bool [BLOCK_M, NB]: blocks whose score (_block_scores) is >= the row's n_sel-th largest
    (rollout.reference.dynamic_block_mask), i.e. blocks with fewer than n_sel strictly larger.
    Up to 128 blocks per row: that rank by one all-pairs count; beyond, the threshold by bisection."""
    if NB <= 128:
        return _larger_count(score, score) < n_sel
    bits = score.to(tl.int32, bitcast=True)
    return bits >= _bisect_threshold(bits, bits, n_sel, BLOCK_M, False)[:, None]


@triton.jit
def _dynamic_selection_two(score_a, score_b, n_sel, BLOCK_M: tl.constexpr, NB: tl.constexpr):
    """_dynamic_selection over a row held as two pieces (score_a [BLOCK_M, NA], score_b [BLOCK_M, NB']; NB:
    their blocks together): each piece's blocks ranked against both pieces', same selection as one tile."""
    if NB <= 128:
        sel_a = _larger_count(score_a, score_a) + _larger_count(score_a, score_b) < n_sel
        sel_b = _larger_count(score_b, score_a) + _larger_count(score_b, score_b) < n_sel
        return sel_a, sel_b
    bits_a = score_a.to(tl.int32, bitcast=True)
    bits_b = score_b.to(tl.int32, bitcast=True)
    t = _bisect_threshold(bits_a, bits_b, n_sel, BLOCK_M, True)
    return bits_a >= t[:, None], bits_b >= t[:, None]


@triton.jit
def _encode_values(
    x0,
    x1,
    k0,
    rows64,
    rmask,
    s_enc,
    s_dec,
    amax,
    codes_ptr,
    scales_ptr,
    K: tl.constexpr,
    OPERAND: tl.constexpr,
    FOUR_OVER_SIX: tl.constexpr,
    FOS_MSE: tl.constexpr,
    E4M3_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """NVFP4-encode columns [k0, k0+BLOCK_K) of BLOCK_M rows (x0/x1: even/odd fp32 [BLOCK_M, BLOCK_K/2]):
    stores codes and scales (not OPERAND) and returns the E2M1 values value(q) (fp32, even/odd) and the block
    scales s_b (fp32 [BLOCK_M, BLOCK_K/16]). FOUR_OVER_SIX (FOS_MSE, E4M3_MAX): the 4over6 recipe, whose
    candidate error also reads the rows' global amax [BLOCK_M]."""
    HALF: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 16
    if OPERAND:  # values only: E2M1 rounding without the codes
        y0, y1, sb_code, sb = nvfp4_block_scaled_recipe(
            x0, x1, s_enc, s_dec, amax, FOUR_OVER_SIX, E4M3_MAX, FOS_MSE, BLOCK_M, BLOCK_K
        )
        q0, q1 = e2m1_round(y0), e2m1_round(y1)
    else:
        pairs = k0 // 2 + tl.arange(0, HALF)
        blocks = k0 // 16 + tl.arange(0, NB)
        packed, sb_code, sb = nvfp4_block_encode_recipe(
            x0, x1, s_enc, s_dec, amax, FOUR_OVER_SIX, E4M3_MAX, FOS_MSE, BLOCK_M, BLOCK_K
        )
        pmask = rmask[:, None] & (pairs[None, :] < K // 2)
        bmask = rmask[:, None] & (blocks[None, :] < K // 16)
        tl.store(codes_ptr + rows64[:, None] * (K // 2) + pairs[None, :], packed.to(tl.uint8), mask=pmask)
        tl.store(scales_ptr + rows64[:, None] * (K // 16) + blocks[None, :], sb_code.to(tl.uint8), mask=bmask)
        q0, q1 = e2m1_value(packed & 15), e2m1_value(packed >> 4)
    return q0, q1, sb


@triton.jit
def _residual_inputs(x0, x1, q0, q1, sb, s_dec, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """(d0, d1, u0, u1) for _residual_store from x and its encoding (_encode_values: E2M1 values q, even/odd fp32
    [BLOCK_M, BLOCK_K/2], block scales sb): the residual d = x - v * S_dec (fp32) of the values v = q * s_b, and
    the operand's fp16 values u = fp16(q * (s_b * 2^-7)) = fp16(v * 2^-7) (exact products: E2M1 x E4M3 fits fp32,
    the power of two stays normal; one multiply an element where no residual is formed)."""
    HALF: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 16
    sb_full = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_M, NB, 8)), (BLOCK_M, HALF))
    sb7_full = tl.reshape(tl.broadcast_to((sb * 0.0078125)[:, :, None], (BLOCK_M, NB, 8)), (BLOCK_M, HALF))
    d0 = x0 - (q0 * sb_full) * s_dec[:, None]
    d1 = x1 - (q1 * sb_full) * s_dec[:, None]
    return d0, d1, (q0 * sb7_full).to(tl.float16), (q1 * sb7_full).to(tl.float16)


@triton.jit
def _residual_store(
    d0,
    d1,
    u0,
    u1,
    sel,
    k0,
    rows64,
    rmask,
    s_enc,
    s_dec,
    amax,
    rcodes_ptr,
    rscales_ptr,
    op_ptr,
    K: tl.constexpr,
    HAS_RES: tl.constexpr,
    OPERAND: tl.constexpr,
    WGMMA_ORDER: tl.constexpr,
    FOUR_OVER_SIX: tl.constexpr,
    FOS_MSE: tl.constexpr,
    E4M3_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The rest of _encode_values' columns (_residual_inputs: d = x - v * S_dec fp32, u = fp16(v * 2^-7)): (HAS_RES)
    the RAC residual d of the selected blocks (sel: bool [BLOCK_M, BLOCK_K/16]) encoded and stored, or folded into
    u; then (OPERAND) the decoded fp16 GEMM operand stored: [M, 2, K/2], or (WGMMA_ORDER) [M, K] in
    gemm_wgmma_launch.operand_permutation's order (see activation_operand)."""
    HALF: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 16
    pairs = k0 // 2 + tl.arange(0, HALF)
    blocks = k0 // 16 + tl.arange(0, NB)
    pmask = rmask[:, None] & (pairs[None, :] < K // 2)
    bmask = rmask[:, None] & (blocks[None, :] < K // 16)
    if HAS_RES:
        sel_full = tl.reshape(tl.broadcast_to(sel[:, :, None], (BLOCK_M, NB, 8)), (BLOCK_M, HALF))
        r0 = tl.where(sel_full != 0, d0, 0.0)
        r1 = tl.where(sel_full != 0, d1, 0.0)
        if OPERAND:
            ry0, ry1, _, rsb = nvfp4_block_scaled_recipe(
                r0, r1, s_enc, s_dec, amax, FOUR_OVER_SIX, E4M3_MAX, FOS_MSE, BLOCK_M, BLOCK_K
            )
            # value(q_r) * s_r * 2^-7 with s_r * 2^-7 once a block: the same exact product (E2M1 x E4M3 fits fp32;
            # the power of two stays normal)
            rsb_full = tl.reshape(tl.broadcast_to((rsb * 0.0078125)[:, :, None], (BLOCK_M, NB, 8)), (BLOCK_M, HALF))
            # fp16(a) + fp16(r) rounded once to fp16: what the GEMM's in-register fold computes
            rv0 = (e2m1_round(ry0) * rsb_full).to(tl.float16).to(tl.float32)
            rv1 = (e2m1_round(ry1) * rsb_full).to(tl.float16).to(tl.float32)
            u0 = (u0.to(tl.float32) + rv0).to(tl.float16)
            u1 = (u1.to(tl.float32) + rv1).to(tl.float16)
        else:
            rpacked, rsb_code, rsb = nvfp4_block_encode_recipe(
                r0, r1, s_enc, s_dec, amax, FOUR_OVER_SIX, E4M3_MAX, FOS_MSE, BLOCK_M, BLOCK_K
            )
            tl.store(rcodes_ptr + rows64[:, None] * (K // 2) + pairs[None, :], rpacked.to(tl.uint8), mask=pmask)
            tl.store(rscales_ptr + rows64[:, None] * (K // 16) + blocks[None, :], rsb_code.to(tl.uint8), mask=bmask)
    if OPERAND:
        if WGMMA_ORDER and BLOCK_K % 128 == 0:  # permute whole 128-chunks in registers, store contiguously
            v = tl.reshape(tl.join(u0, u1), (BLOCK_M, BLOCK_K // 128) + (2,) * 7)
            # element e = (e6..e0) of a chunk (e0 = odd) goes to (e4 e3 e0 e2 e6 e5 e1), as below
            v = tl.reshape(tl.permute(v, (0, 1, 4, 5, 8, 6, 2, 3, 7)), (BLOCK_M, BLOCK_K))
            cols = k0 + tl.arange(0, BLOCK_K)
            tl.store(op_ptr + rows64[:, None] * K + cols[None, :], v, mask=rmask[:, None] & (cols[None, :] < K))
        elif WGMMA_ORDER:  # pair p = 64c + pp (bits pp5..pp0) -> 128c + (pp3 pp2 s pp1 pp5 pp4 pp0), s = odd
            pp = pairs % 64
            pos = (pairs // 64) * 128 + ((pp >> 3) & 1) * 64 + ((pp >> 2) & 1) * 32 + ((pp >> 1) & 1) * 8
            pos += (pp >> 5) * 4 + ((pp >> 4) & 1) * 2 + (pp & 1)
            base = op_ptr + rows64[:, None] * K + pos[None, :]
            tl.store(base, u0, mask=pmask)
            tl.store(base + 16, u1, mask=pmask)
        else:  # [M, 2, K/2]: even elements, then odd elements of each row
            base = op_ptr + rows64[:, None] * K + pairs[None, :]
            tl.store(base, u0, mask=pmask)
            tl.store(base + K // 2, u1, mask=pmask)


@triton.jit
def _encode_store_chunk(
    x0,
    x1,
    k0,
    rows64,
    rmask,
    s_enc,
    s_dec,
    amax,
    mask_ptr,
    codes_ptr,
    scales_ptr,
    rcodes_ptr,
    rscales_ptr,
    op_ptr,
    n_sel,
    K: tl.constexpr,
    HAS_RES: tl.constexpr,
    DYNAMIC: tl.constexpr,
    OPERAND: tl.constexpr,
    WGMMA_ORDER: tl.constexpr,
    FOUR_OVER_SIX: tl.constexpr,
    FOS_MSE: tl.constexpr,
    E4M3_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Encode and store columns [k0, k0+BLOCK_K) of BLOCK_M rows (_encode_values, then _residual_store) with
    the blocks a static plan (mask_ptr) selects or (DYNAMIC: the whole row in this tile) this row's own."""
    NB: tl.constexpr = BLOCK_K // 16
    q0, q1, sb = _encode_values(
        x0, x1, k0, rows64, rmask, s_enc, s_dec, amax, codes_ptr, scales_ptr, K, OPERAND, FOUR_OVER_SIX, FOS_MSE,
        E4M3_MAX, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    d0, d1, u0, u1 = _residual_inputs(x0, x1, q0, q1, sb, s_dec, BLOCK_M, BLOCK_K)
    sel = sb  # not read without a residual
    if HAS_RES:
        if DYNAMIC:  # whole row in registers: pick this token's blocks
            sel = _dynamic_selection(_block_scores(d0, d1, k0, K, BLOCK_M, BLOCK_K), n_sel, BLOCK_M, NB)
        else:
            blocks = k0 // 16 + tl.arange(0, NB)
            sel = tl.load(mask_ptr + blocks, mask=blocks < K // 16, other=0) != 0
            sel = tl.broadcast_to(sel[None, :], (BLOCK_M, NB))
    _residual_store(
        d0, d1, u0, u1, sel, k0, rows64, rmask, s_enc, s_dec, amax, rcodes_ptr, rscales_ptr, op_ptr, K, HAS_RES,
        OPERAND, WGMMA_ORDER, FOUR_OVER_SIX, FOS_MSE, E4M3_MAX, BLOCK_M, BLOCK_K,
    )  # fmt: skip


@triton.jit
def _load_pairs(x_ptr, rows64, rmask, stride_xm, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(even, odd) elements of columns [k0, k0 + BLOCK_K) as fp32 [BLOCK_M, BLOCK_K/2]: one contiguous
    (vectorized) load, split in registers."""
    cols = k0 + tl.arange(0, BLOCK_K)
    m = rmask[:, None] & (cols[None, :] < K)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, (x.shape[0], BLOCK_K // 2, 2)))


@triton.jit
def _load_row_pairs(
    x_ptr,
    rows64,
    lmask,
    stride_xm,
    k0,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    X_BF16: tl.constexpr,
):
    """(even, odd) fp32 [BLOCK_M, BLOCK_K/2] of the rows to quantize: x itself, or (GATED) the gated
    activation h = silu(gate) * up of x = [gate | up] ([M, 2K]), computed in fp32 and rounded to x's
    dtype as rollout.moe_block.gated_activation does. Rows outside lmask read as zeros."""
    if GATED:
        g0, g1 = _load_pairs(x_ptr, rows64, lmask, stride_xm, k0, K, BLOCK_K)
        u0, u1 = _load_pairs(x_ptr + K, rows64, lmask, stride_xm, k0, K, BLOCK_K)
        h0 = tl.div_rn(g0, 1.0 + tl.exp(-g0)) * u0
        h1 = tl.div_rn(g1, 1.0 + tl.exp(-g1)) * u1
        if X_BF16:
            return round_bf16(h0), round_bf16(h1)
        return h0.to(tl.float16).to(tl.float32), h1.to(tl.float16).to(tl.float32)
    return _load_pairs(x_ptr, rows64, lmask, stride_xm, k0, K, BLOCK_K)


@triton.jit
def _global_scales(amax, BLOCK_M: tl.constexpr, E4M3_MAX: tl.constexpr):
    """Per-row S_enc, S_dec from amax [BLOCK_M] exactly as quads_megatron.nvfp4.global_encode_scale
    (S_enc = 6 * E4M3_MAX / amax: 2688 / amax for the plain recipe)."""
    s_enc = tl.minimum(tl.div_rn(tl.full((BLOCK_M,), 6.0 * E4M3_MAX, tl.float32), amax), FP32_MAX)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    return s_enc, tl.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), s_enc)


@triton.jit
def _act_quant_kernel(
    x_ptr,
    valid_ptr,
    amax_ptr,
    mask_ptr,
    codes_ptr,
    scales_ptr,
    rcodes_ptr,
    rscales_ptr,
    op_ptr,
    sdec_ptr,
    offs_ptr,
    tmap_ptr,
    rids_ptr,
    rorder_ptr,
    rpos_ptr,
    rtokens_ptr,
    rvalid_ptr,
    M,
    stride_xm,
    n_sel,
    n_tm,
    E,
    P,
    R_N,
    K: tl.constexpr,
    STATIC: tl.constexpr,
    HAS_RES: tl.constexpr,
    DYNAMIC: tl.constexpr,
    OPERAND: tl.constexpr,
    WGMMA_ORDER: tl.constexpr,
    GATED: tl.constexpr,
    HAS_VALID: tl.constexpr,
    X_BF16: tl.constexpr,
    FOUR_OVER_SIX: tl.constexpr,
    FOS_MSE: tl.constexpr,
    E4M3_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_TM: tl.constexpr,
    TM_BM: tl.constexpr,
    TM_BLOCK_E: tl.constexpr,
    TM_BLOCK_P: tl.constexpr,
    HAS_ROUTE: tl.constexpr,
    R_TOPK: tl.constexpr,
    R_BLOCK: tl.constexpr,
    R_NB: tl.constexpr,
    R_HISTOGRAM: tl.constexpr,
    PDL: tl.constexpr,
):
    """HAS_TM: programs 0 .. n_tm - 1 write a GEMM's row-tile table (tile_map of offs: E experts, P tiles
    of TM_BM rows) next to the quantization, in the same launch. HAS_ROUTE: instead, programs 0 .. E route
    the R_N (token, slot) pairs of rids (route.route_program) and write that table from the routing; the
    others quantize BLOCK_M rows each. SPLIT_K > 0: K = SPLIT_K + a smaller power of two, the row held as those
    two pieces instead of one BLOCK_K tile padded past K (padded lanes cost the SiLU, scale and encode work too)."""
    wait_then_release(PDL)
    pid = tl.program_id(0)
    if HAS_ROUTE:
        if pid <= E:
            route_program(
                rids_ptr, rorder_ptr, rpos_ptr, rtokens_ptr, rvalid_ptr, offs_ptr, tmap_ptr, R_N, E, P, pid,
                R_TOPK, R_BLOCK, R_NB, R_HISTOGRAM, True, TM_BM,
            )  # fmt: skip
            return
        pid -= E + 1
    if HAS_TM:
        if pid < n_tm:
            tile_map_chunk(offs_ptr, tmap_ptr, E, P, pid, TM_BM, TM_BLOCK_E, TM_BLOCK_P)
            return
        pid -= n_tm
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    lmask = rmask  # rows whose input is read (HAS_VALID: the others quantize zeros)
    if HAS_VALID:
        lmask = rmask & (tl.load(valid_ptr + rows64, mask=rmask, other=0) != 0)
    if BLOCK_K >= K:  # the whole row in registers: one read of x (SPLIT_K > 0: as two unpadded pieces)
        FIRST: tl.constexpr = SPLIT_K if SPLIT_K > 0 else BLOCK_K
        x0, x1 = _load_row_pairs(x_ptr, rows64, lmask, stride_xm, 0, K, FIRST, GATED, X_BF16)
        if SPLIT_K > 0:
            y0, y1 = _load_row_pairs(x_ptr, rows64, lmask, stride_xm, SPLIT_K, K, K - SPLIT_K, GATED, X_BF16)
        if STATIC:
            amax = tl.load(amax_ptr + rows * 0, mask=rmask, other=0.0)
        else:
            amax = tl.max(tl.maximum(tl.abs(x0), tl.abs(x1)), axis=1)
            if SPLIT_K > 0:
                amax = tl.maximum(amax, tl.max(tl.maximum(tl.abs(y0), tl.abs(y1)), axis=1))
        s_enc, s_dec = _global_scales(amax, BLOCK_M, E4M3_MAX)
        tl.store(sdec_ptr + rows, s_dec, mask=rmask)
        if SPLIT_K > 0 and DYNAMIC:  # both pieces' values and scores first: the row's blocks ranked together
            REST: tl.constexpr = K - SPLIT_K
            qa0, qa1, sba = _encode_values(
                x0, x1, 0, rows64, rmask, s_enc, s_dec, amax, codes_ptr, scales_ptr, K, OPERAND, FOUR_OVER_SIX,
                FOS_MSE, E4M3_MAX, BLOCK_M, SPLIT_K,
            )  # fmt: skip
            qb0, qb1, sbb = _encode_values(
                y0, y1, SPLIT_K, rows64, rmask, s_enc, s_dec, amax, codes_ptr, scales_ptr, K, OPERAND, FOUR_OVER_SIX,
                FOS_MSE, E4M3_MAX, BLOCK_M, REST,
            )  # fmt: skip
            da0, da1, ua0, ua1 = _residual_inputs(x0, x1, qa0, qa1, sba, s_dec, BLOCK_M, SPLIT_K)
            db0, db1, ub0, ub1 = _residual_inputs(y0, y1, qb0, qb1, sbb, s_dec, BLOCK_M, REST)
            sel_a, sel_b = _dynamic_selection_two(
                _block_scores(da0, da1, 0, K, BLOCK_M, SPLIT_K),
                _block_scores(db0, db1, SPLIT_K, K, BLOCK_M, REST),
                n_sel,
                BLOCK_M,
                K // 16,
            )
            _residual_store(
                db0, db1, ub0, ub1, sel_b, SPLIT_K, rows64, rmask, s_enc, s_dec, amax, rcodes_ptr, rscales_ptr, op_ptr,
                K, HAS_RES, OPERAND, WGMMA_ORDER, FOUR_OVER_SIX, FOS_MSE, E4M3_MAX, BLOCK_M, REST,
            )  # fmt: skip
            _residual_store(
                da0, da1, ua0, ua1, sel_a, 0, rows64, rmask, s_enc, s_dec, amax, rcodes_ptr, rscales_ptr, op_ptr,
                K, HAS_RES, OPERAND, WGMMA_ORDER, FOUR_OVER_SIX, FOS_MSE, E4M3_MAX, BLOCK_M, SPLIT_K,
            )  # fmt: skip
            return
        if SPLIT_K > 0:
            _encode_store_chunk(
                y0, y1, SPLIT_K, rows64, rmask, s_enc, s_dec, amax, mask_ptr, codes_ptr, scales_ptr, rcodes_ptr,
                rscales_ptr, op_ptr, n_sel, K, HAS_RES, DYNAMIC, OPERAND, WGMMA_ORDER, FOUR_OVER_SIX, FOS_MSE,
                E4M3_MAX, BLOCK_M, K - SPLIT_K,
            )  # fmt: skip
        _encode_store_chunk(
            x0,
            x1,
            0,
            rows64,
            rmask,
            s_enc,
            s_dec,
            amax,
            mask_ptr,
            codes_ptr,
            scales_ptr,
            rcodes_ptr,
            rscales_ptr,
            op_ptr,
            n_sel,
            K,
            HAS_RES,
            DYNAMIC,
            OPERAND,
            WGMMA_ORDER,
            FOUR_OVER_SIX,
            FOS_MSE,
            E4M3_MAX,
            BLOCK_M,
            FIRST,
        )
    else:  # two passes over K chunks: amax, then encode
        if STATIC:
            amax = tl.load(amax_ptr + rows * 0, mask=rmask, other=0.0)
        else:
            amax = tl.zeros((BLOCK_M,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x0, x1 = _load_row_pairs(x_ptr, rows64, lmask, stride_xm, k0, K, BLOCK_K, GATED, X_BF16)
                amax = tl.maximum(amax, tl.max(tl.maximum(tl.abs(x0), tl.abs(x1)), axis=1))
        s_enc, s_dec = _global_scales(amax, BLOCK_M, E4M3_MAX)
        tl.store(sdec_ptr + rows, s_dec, mask=rmask)
        for k0 in range(0, K, BLOCK_K):
            x0, x1 = _load_row_pairs(x_ptr, rows64, lmask, stride_xm, k0, K, BLOCK_K, GATED, X_BF16)
            _encode_store_chunk(
                x0,
                x1,
                k0,
                rows64,
                rmask,
                s_enc,
                s_dec,
                amax,
                mask_ptr,
                codes_ptr,
                scales_ptr,
                rcodes_ptr,
                rscales_ptr,
                op_ptr,
                n_sel,
                K,
                HAS_RES,
                DYNAMIC,
                OPERAND,
                WGMMA_ORDER,
                FOUR_OVER_SIX,
                FOS_MSE,
                E4M3_MAX,
                BLOCK_M,
                BLOCK_K,
            )


WGMMA_CHUNK = 128  # K elements per permutation chunk of the "wgmma" operand order (gemm_wgmma_launch)


def check_wgmma_order(k: int) -> None:
    """The "wgmma" operand order permutes K inside 128-element chunks: K must be a multiple of 128."""
    if k % WGMMA_CHUNK:
        raise ValueError(f"the wgmma operand order needs K % {WGMMA_CHUNK} == 0, got K={k}")


@dataclass(frozen=True)
class ActivationOperand:
    """A GEMM's decoded activation operand for x [M, K], made once per GEMM.

    values: fp16 (value(q) * s_b [+ value(q_r) * s_r]) * 2^-7, exactly what the GEMM would decode
        from the codes in registers, with the RAC residual already folded in (one fp16 sum: exact
        unless the two terms span more than 11 bits). order "pairs": [M, 2, K/2], even elements then
        odd elements of each row (gemm_triton.grouped_w4a4); order "wgmma": [M, K] permuted inside each
        128-chunk as gemm_wgmma_launch.operand_permutation (the Gluon Hopper GEMM).
    global_decode: S_dec [M, 1] of the per-token (or static) global scale.
    tiles: the row tiles of a grouped GEMM, where asked for (activation_operand(row_tiles=... or route=...)).
    routing: the MoE routing the same launch made (activation_operand(route=...)), else None.
    """

    values: torch.Tensor
    global_decode: torch.Tensor
    order: str = "pairs"
    tiles: RowTiles | None = None
    routing: Routing | None = None


_TM_BLOCK_P = 32  # row tiles per tile-map program inside the activation launch ([32, E] compares per program)


def row_split(k: int, block_k: int, order: str, residual: bool = False, want: bool | None = None) -> int:
    """SPLIT_K of a launch: where the whole row is held (block_k >= K) and K is a power of two P plus a smaller one
    (768 = 512 + 256: fc2's input of a Qwen3-30B-A3B expert), P; else 0 (one tile of block_k, padded past K). In
    the "wgmma" order only where both pieces are whole 128-chunks; dynamic RAC ranks the blocks of both pieces
    together. want: the tile's split_row (ActQuantConfig); None: where the launch writes no residual (H100
    2026-12-07, at the tuned tiles: 24-29% faster without RAC, 8-13% slower with a static plan's residual at 4
    warps). QUADS_ACT_SPLIT_ROW overrides both (A/B): 1, wherever it can; 0, never. The same bits either way."""
    mode = os.environ.get("QUADS_ACT_SPLIT_ROW", "")
    if mode not in ("", "0", "1"):
        raise ValueError(f"QUADS_ACT_SPLIT_ROW must be 0, 1 or unset, got {mode!r}")
    split = mode == "1" if mode else (not residual if want is None else want)
    if block_k < k or not split:
        return 0
    p = 1 << (k.bit_length() - 1)
    rest = k - p
    if rest < 16 or rest & (rest - 1) or (order == "wgmma" and rest % WGMMA_CHUNK):
        return 0
    return p


def _launch_act_quant(
    x: torch.Tensor,
    plan: RACPlan | None,
    static_amax: torch.Tensor | None,
    config: ActQuantConfig | None,
    check: bool,
    block_mask: torch.Tensor | None,
    operand: bool,
    dynamic_channels: int,
    gated: bool = False,
    row_valid: torch.Tensor | None = None,
    order: str = "pairs",
    row_tiles: tuple[torch.Tensor, int, int] | None = None,
    recipe: NVFP4Recipe | None = None,
    route: tuple[torch.Tensor, int, int] | None = None,
) -> QuantizedActivation | ActivationOperand:
    recipe = nvfp4._recipe(recipe)
    if route is not None and row_tiles is not None:
        raise ValueError("route= writes the row tiles itself: pass route= or row_tiles=, not both")
    if route is not None and (route[0].dim() != 2 or route[0].shape[0] != x.shape[0] or gated):
        raise ValueError(
            f"route=: topk ids must be [T={x.shape[0]}, k] for a per-token (not gated) x, got {tuple(route[0].shape)}"
        )
    if order not in ("pairs", "wgmma"):
        raise ValueError(f"operand order must be 'pairs' or 'wgmma', got {order!r}")
    if config is not None and not isinstance(config, ActQuantConfig):
        raise TypeError(f"config must be an ActQuantConfig, got {type(config).__name__}")
    if check and row_valid is None:
        nvfp4.check_quantizable(x, "activation")
    if x.dim() != 2:
        raise ValueError(f"activation must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    if gated:
        if k % 32 or x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"gated input must be bf16/fp16 [M, 2I] with I a multiple of 16, got {x.dtype} {tuple(x.shape)}"
            )
        k //= 2
    if row_valid is not None and (row_valid.shape != (m,) or row_valid.dtype not in (torch.bool, torch.int8)):
        raise ValueError(f"row_valid must be bool/int8 [{m}], got {row_valid.dtype} {tuple(row_valid.shape)}")
    if check and row_valid is not None:  # rows it drops are never read (they quantize as zeros): anything goes
        nvfp4.check_quantizable(x[row_valid.bool()], "activation")
    check_rac_selection(k, plan, dynamic_channels)
    n_sel = min(dynamic_channels, k) // 16
    if x.stride(-1) != 1:
        x = x.contiguous()
    tile = act_quant_config(m, k, plan is not None, n_sel > 0, gated, x.device, config)
    block_m, block_k, num_warps = tile.block_m, tile.block_k, tile.num_warps
    if n_sel and block_k < k:
        raise ValueError(f"dynamic RAC selects per row: block_k={block_k} must cover K={k}")
    has_res = n_sel > 0 or (plan is not None and plan.blocks.numel() > 0)
    split_k = row_split(k, block_k, order, has_res, tile.split_row)
    dev = x.device
    sdec = torch.empty((m,), dtype=torch.float32, device=dev)
    if operand:
        if order == "wgmma":
            check_wgmma_order(k)
        op = torch.empty((m, k) if order == "wgmma" else (m, 2, k // 2), dtype=torch.float16, device=dev)
        codes = scales = rcodes = rscales = op  # not written in operand mode
    else:
        op = sdec  # not written
        codes = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
        scales = torch.empty((m, k // 16), dtype=torch.uint8, device=dev)
        rcodes = torch.empty_like(codes) if has_res else codes
        rscales = torch.empty_like(scales) if has_res else scales
    if not has_res or n_sel:
        mask = torch.zeros(1, dtype=torch.int8, device=dev)
    elif block_mask is not None:  # precomputed on the device (e.g. for CUDA-graph capture)
        mask = block_mask.to(device=dev, dtype=torch.int8)
    else:
        mask = plan.block_mask(dev).to(torch.int8)
    amax = static_amax.detach().float().reshape(1).to(dev) if static_amax is not None else sdec
    tiles, offs, n_tm, e_count, tm_block_e = None, sdec, 0, 0, 2
    rl, n_route = None, 0
    if route is not None:  # routing and its row tiles by E + 1 extra programs of this launch
        topk_ids, e_count, block_rows = route
        rl = route_launch(topk_ids.to(dev), e_count, block_rows)
        if rl.args[0] == 0:
            raise ValueError("route=: no (token, slot) pairs to route")
        tiles, offs, n_route = rl.tiles, rl.routing.offs, e_count + 1
    if row_tiles is not None:  # the GEMM's row-tile table, written by extra programs of this launch
        offs, block_rows, rows = row_tiles
        offs = offs.to(device=dev, dtype=torch.int32)
        e_count, tm_block_e = offs.numel(), triton.next_power_of_2(max(offs.numel(), 2))
        table = torch.empty((RowTiles.count(rows, block_rows, e_count), 4), dtype=torch.int32, device=dev)
        tiles = RowTiles(table, block_rows, rows)
        n_tm = triton.cdiv(tiles.table.shape[0], _TM_BLOCK_P)
    r_ptrs = rl.pointers[:5] if rl is not None else (sdec,) * 5
    _act_quant_kernel[(n_route + n_tm + triton.cdiv(m, block_m),)](
        x,
        x if row_valid is None else row_valid.view(torch.int8),
        amax,
        mask,
        codes,
        scales,
        rcodes,
        rscales,
        op,
        sdec,
        offs,
        sdec if tiles is None else tiles.table,
        *r_ptrs,
        m,
        x.stride(0),
        n_sel,
        n_tm,
        e_count,
        0 if tiles is None else tiles.table.shape[0],
        0 if rl is None else rl.args[0],
        K=k,
        STATIC=static_amax is not None,
        HAS_RES=has_res,
        DYNAMIC=n_sel > 0,
        OPERAND=operand,
        WGMMA_ORDER=order == "wgmma",
        GATED=gated,
        HAS_VALID=row_valid is not None,
        X_BF16=x.dtype == torch.bfloat16,
        FOUR_OVER_SIX=recipe.use_4over6,
        FOS_MSE=recipe.err_mode == "MSE",
        E4M3_MAX=float(recipe.e4m3_max),
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        HAS_TM=n_tm > 0,
        TM_BM=1 if tiles is None else tiles.block_rows,
        TM_BLOCK_E=tm_block_e,
        TM_BLOCK_P=_TM_BLOCK_P,
        HAS_ROUTE=rl is not None,
        R_TOPK=1 if rl is None else rl.consts["TOPK"],
        R_BLOCK=16 if rl is None else rl.consts["BLOCK"],
        R_NB=2 if rl is None else rl.consts["NB"],
        R_HISTOGRAM=True if rl is None else rl.consts["HISTOGRAM"],
        num_warps=num_warps,
        enable_fp_fusion=False,  # keep x - (v*s_b)*S_dec rounded as the torch reference does
        **pdl.launch_options(dev),
    )
    g = sdec.reshape(m, 1)
    if operand:
        return ActivationOperand(op, g, order, tiles, None if rl is None else rl.result())
    xq = NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), g)
    res = NVFP4Tensor(rcodes, rscales.view(torch.float8_e4m3fn), g) if has_res else None
    return QuantizedActivation(xq, res)


def quantize_activation(
    x: torch.Tensor,
    plan: RACPlan | None = None,
    static_amax: torch.Tensor | None = None,
    config: ActQuantConfig | None = None,
    check: bool = True,
    block_mask: torch.Tensor | None = None,
    dynamic_channels: int = 0,
    recipe: NVFP4Recipe | None = None,
) -> QuantizedActivation:
    """Triton twin of quads_megatron.rollout.reference.quantize_activation (same bits; a static RAC plan
    or dynamic per-token selection, dynamic_channels, which needs the whole row per program).

    config: the tiles (fields left None, or config None: the tuned ones for this call). block_mask:
    the plan's int8 [K/16] mask already on the device (no host-to-device copy, e.g. inside CUDA-graph
    capture). recipe: the activations' NVFP4 variant (None: plain).
    """
    return _launch_act_quant(x, plan, static_amax, config, check, block_mask, False, dynamic_channels, recipe=recipe)


def activation_operand(
    x: torch.Tensor,
    plan: RACPlan | None = None,
    static_amax: torch.Tensor | None = None,
    config: ActQuantConfig | None = None,
    check: bool = True,
    block_mask: torch.Tensor | None = None,
    dynamic_channels: int = 0,
    gated: bool = False,
    row_valid: torch.Tensor | None = None,
    order: str = "pairs",
    row_tiles: tuple[torch.Tensor, int, int] | None = None,
    recipe: NVFP4Recipe | None = None,
    route: tuple[torch.Tensor, int, int] | None = None,
) -> ActivationOperand:
    """Quantize x like quantize_activation, but emit the GEMM's decoded fp16 operand instead of codes
    (same arguments): the GEMM then decodes only the weights, and RAC costs it nothing.

    gated: x is fc1's output [M, 2I] = [gate | up] (bf16/fp16) and the operand is made for
    rollout.moe_block.gated_activation(x) [M, I] (SiLU in fp32, rounded to x.dtype) without writing it.
    row_valid: bool/int8 [M]; rows where it is 0 are quantized as zeros (foreign-expert rows).
    order: "pairs" for gemm_triton.grouped_w4a4, "wgmma" for gemm_wgmma_launch.grouped_w4a4_wgmma.
    row_tiles: (offs int32 [E], block_rows, rows): the same launch also writes the RowTiles of a grouped
    GEMM over offs' rows (returned as .tiles, for the GEMMs' tiles= argument).
    recipe: the activations' NVFP4 variant (None: plain).
    route: (topk_ids [T, k], E, block_rows): the same launch also routes the MoE block (route.route: returned
    as .routing, T * k <= route.ROUTE_MAX_ROWS) and writes its grouped rows' RowTiles (.tiles); x is then the
    block's per-token input (routing and fc1's quantization do not depend on each other).
    """
    return _launch_act_quant(
        x,
        plan,
        static_amax,
        config,
        check,
        block_mask,
        True,
        dynamic_channels,
        gated,
        row_valid,
        order,
        row_tiles,
        recipe,
        route,
    )
