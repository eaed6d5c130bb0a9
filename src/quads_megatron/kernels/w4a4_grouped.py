"""Hopper W4A4 NVFP4 MoE kernels (Triton): fused activation+residual quantization and a grouped GEMM.

* quantize_activation: x [M, K] -> per-token NVFP4 codes/scales, S_dec [M, 1], and (RAC, static
  plan or dynamic per-token selection) the dense residual codes/scales, bit-identical to
  quads_megatron.w4a4.quantize_activation; activation_operand emits the decoded GEMM operand
  (optionally of SiLU(gate) * up computed in the same pass, for an MoE block's fc2).
* grouped_w4a4: y[rows of expert e] = S_dec_x * S_dec_w[e] * ([A | R_S] @ [W_e | W_e,S]^T).
  FP4 codes are decoded in registers to fp16 by bit operations (PTX on the GPU; value * E4M3
  scale * 2^-7 is exact in fp16), products run on the fp16 tensor cores, sums accumulate in fp32.
  Because W_S are W's own columns (same codes and scales), the augmented-K product is computed
  as (A + R) @ W^T with the residual added to the decoded activation tile: no extra MMA and no
  extra weight traffic. A + R is exact in fp16 unless the two terms span more than 11 bits
  (then it rounds at 2^-11 relative); without RAC every product is exact.
  Expert rows follow ``offs`` (cumulative row ends, as torch._grouped_mm); tiles are scheduled
  on device (no host sync: a row-tile table, RowTiles, which the activation quantization's launch
  can write with extra programs); rows may read their activation through an index (a_rows).
* Every kernel waits for the previous kernel's writes before its first read and then lets the next
  one launch: on sm_90+ they are launched programmatically dependent (kernels/pdl.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quads_megatron import nvfp4
from quads_megatron.kernels import pdl
from quads_megatron.kernels.nvfp4_quant import FP32_MAX, e2m1_round, nvfp4_block_encode, nvfp4_block_scaled
from quads_megatron.kernels.pdl import wait_then_release
from quads_megatron.nvfp4 import NVFP4Tensor
from quads_megatron.rollout.rac_plan import QuantizedActivation, RACPlan, check_rac_selection


@triton.jit
def round_bf16(y):
    """fp32 -> the nearest-even bf16 value, still as fp32 (bit ops: the interpreter's own cast truncates)."""
    yb = y.to(tl.int32, bitcast=True)
    return ((yb + 0x7FFF + ((yb >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


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


# ----------------------------------------------------------------------------- activation quant


@triton.jit
def _dynamic_selection(
    x0, x1, v0, v1, s_dec, blocks, n_sel, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    """bool [BLOCK_M, BLOCK_K/16]: blocks whose residual amax is >= the row's n_sel-th largest
    (quads_megatron.w4a4.dynamic_block_mask), i.e. blocks with fewer than n_sel strictly larger.

    Up to 128 blocks per row: that rank by one all-pairs count. Beyond: the threshold by bisection
    on the fp32 bit patterns (monotonic for non-negative floats): the largest t with
    count(score >= t) >= n_sel (31 row reductions, but no NB x NB tile in registers)."""
    NB: tl.constexpr = BLOCK_K // 16
    r = tl.maximum(tl.abs(x0 - v0 * s_dec[:, None]), tl.abs(x1 - v1 * s_dec[:, None]))
    score = tl.max(tl.reshape(r, (BLOCK_M, NB, 8)), axis=2)
    score = tl.where(blocks[None, :] < K // 16, score, -1.0)  # padding blocks never count
    if NB <= 128:
        larger = tl.sum((score[:, None, :] > score[:, :, None]).to(tl.int32), axis=2)
        return larger < n_sel
    bits = score.to(tl.int32, bitcast=True)
    lo = tl.zeros((BLOCK_M,), tl.int32)
    hi = tl.full((BLOCK_M,), 0x7F800000, tl.int32)
    for _ in tl.static_range(31):
        mid = lo + (hi - lo + 1) // 2
        ok = tl.sum((bits >= mid[:, None]).to(tl.int32), axis=1) >= n_sel
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return bits >= lo[:, None]


@triton.jit
def _encode_store_chunk(
    x0,
    x1,
    k0,
    rows64,
    rmask,
    s_enc,
    s_dec,
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
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Encode columns [k0, k0+BLOCK_K) of BLOCK_M rows (x0/x1: even/odd fp32 [BLOCK_M, BLOCK_K/2]) and store
    codes and scales, or (OPERAND) the decoded fp16 GEMM operand: [M, 2, K/2], or (WGMMA_ORDER) [M, K] in
    w4a4_wgmma.operand_permutation's order (see activation_operand)."""
    HALF: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 16
    pairs = k0 // 2 + tl.arange(0, HALF)
    blocks = k0 // 16 + tl.arange(0, NB)
    pmask = rmask[:, None] & (pairs[None, :] < K // 2)
    bmask = rmask[:, None] & (blocks[None, :] < K // 16)
    if OPERAND:  # values only: E2M1 rounding without the codes
        y0, y1, sb_code, sb = nvfp4_block_scaled(x0, x1, s_enc, s_dec, BLOCK_M, BLOCK_K)
        q0, q1 = e2m1_round(y0), e2m1_round(y1)
    else:
        packed, sb_code, sb = nvfp4_block_encode(x0, x1, s_enc, s_dec, BLOCK_M, BLOCK_K)
        tl.store(codes_ptr + rows64[:, None] * (K // 2) + pairs[None, :], packed.to(tl.uint8), mask=pmask)
        tl.store(scales_ptr + rows64[:, None] * (K // 16) + blocks[None, :], sb_code.to(tl.uint8), mask=bmask)
        q0, q1 = e2m1_value(packed & 15), e2m1_value(packed >> 4)
    sb_full = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_M, NB, 8)), (BLOCK_M, HALF))
    v0 = q0 * sb_full  # value(q) * s_b: exact in fp32
    v1 = q1 * sb_full
    if HAS_RES:
        if DYNAMIC:  # whole row in registers: pick this token's blocks
            sel = _dynamic_selection(x0, x1, v0, v1, s_dec, blocks, n_sel, K, BLOCK_M, BLOCK_K)
        else:
            sel = tl.load(mask_ptr + blocks, mask=blocks < K // 16, other=0) != 0
            sel = tl.broadcast_to(sel[None, :], (BLOCK_M, NB))
        sel_full = tl.reshape(tl.broadcast_to(sel[:, :, None], (BLOCK_M, NB, 8)), (BLOCK_M, HALF))
        r0 = tl.where(sel_full != 0, x0 - v0 * s_dec[:, None], 0.0)
        r1 = tl.where(sel_full != 0, x1 - v1 * s_dec[:, None], 0.0)
        if OPERAND:
            ry0, ry1, _, rsb = nvfp4_block_scaled(r0, r1, s_enc, s_dec, BLOCK_M, BLOCK_K)
            rsb_full = tl.reshape(tl.broadcast_to(rsb[:, :, None], (BLOCK_M, NB, 8)), (BLOCK_M, HALF))
            # fp16(a) + fp16(r) rounded once to fp16: what the GEMM's in-register fold computes
            rv0 = (e2m1_round(ry0) * rsb_full * 0.0078125).to(tl.float16).to(tl.float32)
            rv1 = (e2m1_round(ry1) * rsb_full * 0.0078125).to(tl.float16).to(tl.float32)
            v0 = (v0 * 0.0078125).to(tl.float16).to(tl.float32) + rv0
            v1 = (v1 * 0.0078125).to(tl.float16).to(tl.float32) + rv1
        else:
            rpacked, rsb_code, rsb = nvfp4_block_encode(r0, r1, s_enc, s_dec, BLOCK_M, BLOCK_K)
            tl.store(rcodes_ptr + rows64[:, None] * (K // 2) + pairs[None, :], rpacked.to(tl.uint8), mask=pmask)
            tl.store(rscales_ptr + rows64[:, None] * (K // 16) + blocks[None, :], rsb_code.to(tl.uint8), mask=bmask)
    elif OPERAND:
        v0 = v0 * 0.0078125
        v1 = v1 * 0.0078125
    if OPERAND:
        if WGMMA_ORDER and BLOCK_K % 128 == 0:  # permute whole 128-chunks in registers, store contiguously
            v = tl.reshape(tl.join(v0.to(tl.float16), v1.to(tl.float16)), (BLOCK_M, BLOCK_K // 128) + (2,) * 7)
            # element e = (e6..e0) of a chunk (e0 = odd) goes to (e4 e3 e0 e2 e6 e5 e1), as below
            v = tl.reshape(tl.permute(v, (0, 1, 4, 5, 8, 6, 2, 3, 7)), (BLOCK_M, BLOCK_K))
            cols = k0 + tl.arange(0, BLOCK_K)
            tl.store(op_ptr + rows64[:, None] * K + cols[None, :], v, mask=rmask[:, None] & (cols[None, :] < K))
        elif WGMMA_ORDER:  # pair p = 64c + pp (bits pp5..pp0) -> 128c + (pp3 pp2 s pp1 pp5 pp4 pp0), s = odd
            pp = pairs % 64
            pos = (pairs // 64) * 128 + ((pp >> 3) & 1) * 64 + ((pp >> 2) & 1) * 32 + ((pp >> 1) & 1) * 8
            pos += (pp >> 5) * 4 + ((pp >> 4) & 1) * 2 + (pp & 1)
            base = op_ptr + rows64[:, None] * K + pos[None, :]
            tl.store(base, v0.to(tl.float16), mask=pmask)
            tl.store(base + 16, v1.to(tl.float16), mask=pmask)
        else:  # [M, 2, K/2]: even elements, then odd elements of each row
            base = op_ptr + rows64[:, None] * K + pairs[None, :]
            tl.store(base, v0.to(tl.float16), mask=pmask)
            tl.store(base + K // 2, v1.to(tl.float16), mask=pmask)


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
    dtype as moe_w4a4.gated_activation does. Rows outside lmask read as zeros."""
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
def _global_scales(amax, BLOCK_M: tl.constexpr):
    """Per-row S_enc, S_dec from amax [BLOCK_M] exactly as quads_megatron.nvfp4.global_encode_scale."""
    s_enc = tl.minimum(tl.div_rn(tl.full((BLOCK_M,), 2688.0, tl.float32), amax), FP32_MAX)
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
    M,
    stride_xm,
    n_sel,
    n_tm,
    E,
    P,
    K: tl.constexpr,
    STATIC: tl.constexpr,
    HAS_RES: tl.constexpr,
    DYNAMIC: tl.constexpr,
    OPERAND: tl.constexpr,
    WGMMA_ORDER: tl.constexpr,
    GATED: tl.constexpr,
    HAS_VALID: tl.constexpr,
    X_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_TM: tl.constexpr,
    TM_BM: tl.constexpr,
    TM_BLOCK_E: tl.constexpr,
    TM_BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """HAS_TM: programs 0 .. n_tm - 1 write a GEMM's row-tile table (tile_map of offs: E experts, P tiles
    of TM_BM rows) next to the quantization, in the same launch; the others quantize BLOCK_M rows each."""
    wait_then_release(PDL)
    pid = tl.program_id(0)
    if HAS_TM:
        if pid < n_tm:
            _tile_map_chunk(offs_ptr, tmap_ptr, E, P, pid, TM_BM, TM_BLOCK_E, TM_BLOCK_P)
            return
        pid -= n_tm
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    lmask = rmask  # rows whose input is read (HAS_VALID: the others quantize zeros)
    if HAS_VALID:
        lmask = rmask & (tl.load(valid_ptr + rows64, mask=rmask, other=0) != 0)
    if BLOCK_K >= K:  # the whole row in registers: one read of x
        x0, x1 = _load_row_pairs(x_ptr, rows64, lmask, stride_xm, 0, K, BLOCK_K, GATED, X_BF16)
        if STATIC:
            amax = tl.load(amax_ptr + rows * 0, mask=rmask, other=0.0)
        else:
            amax = tl.max(tl.maximum(tl.abs(x0), tl.abs(x1)), axis=1)
        s_enc, s_dec = _global_scales(amax, BLOCK_M)
        tl.store(sdec_ptr + rows, s_dec, mask=rmask)
        _encode_store_chunk(
            x0,
            x1,
            0,
            rows64,
            rmask,
            s_enc,
            s_dec,
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
            BLOCK_M,
            BLOCK_K,
        )
    else:  # two passes over K chunks: amax, then encode
        if STATIC:
            amax = tl.load(amax_ptr + rows * 0, mask=rmask, other=0.0)
        else:
            amax = tl.zeros((BLOCK_M,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x0, x1 = _load_row_pairs(x_ptr, rows64, lmask, stride_xm, k0, K, BLOCK_K, GATED, X_BF16)
                amax = tl.maximum(amax, tl.max(tl.maximum(tl.abs(x0), tl.abs(x1)), axis=1))
        s_enc, s_dec = _global_scales(amax, BLOCK_M)
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
                BLOCK_M,
                BLOCK_K,
            )


WGMMA_CHUNK = 128  # K elements per permutation chunk of the "wgmma" operand order (kernels/w4a4_wgmma.py)


def check_wgmma_order(k: int) -> None:
    """The "wgmma" operand order permutes K inside 128-element chunks: K must be a multiple of 128."""
    if k % WGMMA_CHUNK:
        raise ValueError(f"the wgmma operand order needs K % {WGMMA_CHUNK} == 0, got K={k}")


@dataclass(frozen=True)
class ActivationOperand:
    """The Hopper GEMM's activation operand for x [M, K], made once per GEMM.

    values: fp16 (value(q) * s_b [+ value(q_r) * s_r]) * 2^-7, exactly what the GEMM would decode
        from the codes in registers, with the RAC residual already folded in (fp16 sum, see the
        module docstring). order "pairs": [M, 2, K/2], even elements then odd elements of each row
        (grouped_w4a4); order "wgmma": [M, K] permuted inside each 128-chunk as
        w4a4_wgmma.operand_permutation (the Hopper Gluon GEMM).
    global_decode: S_dec [M, 1] of the per-token (or static) global scale.
    tiles: the row tiles of a grouped GEMM, where asked for (activation_operand(row_tiles=...)).
    """

    values: torch.Tensor
    global_decode: torch.Tensor
    order: str = "pairs"
    tiles: RowTiles | None = None


_TM_BLOCK_P = 32  # row tiles per tile-map program inside the activation launch ([32, E] compares per program)


def _launch_act_quant(
    x,
    plan,
    static_amax,
    block_m,
    block_k,
    check,
    num_warps,
    block_mask,
    operand,
    dynamic_channels,
    gated=False,
    row_valid=None,
    order="pairs",
    row_tiles=None,
):
    if order not in ("pairs", "wgmma"):
        raise ValueError(f"operand order must be 'pairs' or 'wgmma', got {order!r}")
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
    if block_k is None:
        block_k = triton.next_power_of_2(k) if k <= 4096 or n_sel else 512
    if n_sel and block_k < k:
        raise ValueError(f"dynamic RAC selects per row: block_k={block_k} must cover K={k}")
    if block_m is None:  # H200 sweep (benchmarks/probe_act_quant_tiles.py)
        block_m = 1
    if num_warps is None:  # without a residual, one warp per row where the launch is throughput-bound
        num_warps = 4 if (n_sel or plan is not None) else (1 if m >= (8192 if gated else 16384) else 2)
    dev = x.device
    has_res = n_sel > 0 or (plan is not None and plan.blocks.numel() > 0)
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
    if row_tiles is not None:  # the GEMM's row-tile table, written by extra programs of this launch
        offs, block_rows, rows = row_tiles
        offs = offs.to(device=dev, dtype=torch.int32)
        e_count, tm_block_e = offs.numel(), triton.next_power_of_2(max(offs.numel(), 2))
        table = torch.empty((RowTiles.count(rows, block_rows, e_count), 4), dtype=torch.int32, device=dev)
        tiles = RowTiles(table, block_rows, rows)
        n_tm = triton.cdiv(tiles.table.shape[0], _TM_BLOCK_P)
    _act_quant_kernel[(n_tm + triton.cdiv(m, block_m),)](
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
        m,
        x.stride(0),
        n_sel,
        n_tm,
        e_count,
        0 if tiles is None else tiles.table.shape[0],
        K=k,
        STATIC=static_amax is not None,
        HAS_RES=has_res,
        DYNAMIC=n_sel > 0,
        OPERAND=operand,
        WGMMA_ORDER=order == "wgmma",
        GATED=gated,
        HAS_VALID=row_valid is not None,
        X_BF16=x.dtype == torch.bfloat16,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        HAS_TM=tiles is not None,
        TM_BM=1 if tiles is None else tiles.block_rows,
        TM_BLOCK_E=tm_block_e,
        TM_BLOCK_P=_TM_BLOCK_P,
        num_warps=num_warps,
        enable_fp_fusion=False,  # keep x - (v*s_b)*S_dec rounded as the torch reference does
        **pdl.launch_options(dev),
    )
    g = sdec.reshape(m, 1)
    if operand:
        return ActivationOperand(op, g, order, tiles)
    xq = NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), g)
    res = NVFP4Tensor(rcodes, rscales.view(torch.float8_e4m3fn), g) if has_res else None
    return QuantizedActivation(xq, res)


def quantize_activation(
    x: torch.Tensor,
    plan: RACPlan | None = None,
    static_amax: torch.Tensor | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
    check: bool = True,
    num_warps: int | None = None,
    block_mask: torch.Tensor | None = None,
    dynamic_channels: int = 0,
) -> QuantizedActivation:
    """Triton twin of quads_megatron.w4a4.quantize_activation (same bits, static plan or dynamic per-token RAC).

    Defaults: the whole row in registers when K <= 4096 (one read of x), one row per program, 2
    warps (4 with a residual): the H200 sweep's best at every M. block_mask: the plan's int8
    [K/16] mask already on the device (avoids a host-to-device copy, e.g. inside CUDA-graph
    capture). dynamic_channels: per-token RAC selection (w4a4.dynamic_block_mask), which needs the
    whole row per program.
    """
    return _launch_act_quant(
        x, plan, static_amax, block_m, block_k, check, num_warps, block_mask, False, dynamic_channels
    )


def activation_operand(
    x: torch.Tensor,
    plan: RACPlan | None = None,
    static_amax: torch.Tensor | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
    check: bool = True,
    num_warps: int | None = None,
    block_mask: torch.Tensor | None = None,
    dynamic_channels: int = 0,
    gated: bool = False,
    row_valid: torch.Tensor | None = None,
    order: str = "pairs",
    row_tiles: tuple[torch.Tensor, int, int] | None = None,
) -> ActivationOperand:
    """Quantize x like quantize_activation, but emit the GEMM's decoded fp16 operand instead of codes
    (same arguments). The Hopper GEMM then decodes only the weights, and RAC costs it nothing.

    gated: x is fc1's output [M, 2I] = [gate | up] (bf16/fp16) and the operand is made for
    moe_w4a4.gated_activation(x) [M, I] (SiLU in fp32, rounded to x.dtype) without writing it.
    row_valid: bool/int8 [M]; rows where it is 0 are quantized as zeros (foreign-expert rows).
    order: "pairs" for grouped_w4a4, "wgmma" for w4a4_wgmma.grouped_w4a4_wgmma (see ActivationOperand).
    row_tiles: (offs int32 [E], block_rows, rows): the same launch also writes the RowTiles of a grouped
    GEMM over offs' rows (returned as .tiles; for the GEMMs' tiles= argument), instead of a launch of
    its own in the GEMM's chain.
    """
    return _launch_act_quant(
        x,
        plan,
        static_amax,
        block_m,
        block_k,
        check,
        num_warps,
        block_mask,
        True,
        dynamic_channels,
        gated,
        row_valid,
        order,
        row_tiles,
    )


# ----------------------------------------------------------------------------- grouped GEMM


def _nibble_ptx(hi: bool) -> str:
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


_PTX_LO = tl.constexpr(_nibble_ptx(False))
_PTX_HI = tl.constexpr(_nibble_ptx(True))


@triton.jit
def _fp4_bits_to_fp16(c, HI: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed code bytes (uint8) -> fp16 value * 2^-14 of the low (HI=False) or high nibble.

    fp16 bits (code & 7) << 9 | (code & 8) << 12 are exactly value * 2^-14, subnormals included.
    USE_ASM (GPU): 4 bytes per PTX sequence (_nibble_ptx); otherwise plain integer ops (also the
    interpreter's path, and the GPU twin the device checks compare bit for bit).
    """
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm=_PTX_HI if HI else _PTX_LO, constraints="=r,=r,r", args=[c], dtype=tl.float16, is_pure=True, pack=4
        )
    ci = c.to(tl.int32)
    if HI:
        bits = ((ci & 0x70) << 5) | ((ci & 0x80) << 8)
    else:
        bits = ((ci & 7) << 9) | ((ci & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _load_decoded(
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
    (A 3-D [rows, blocks, 8] variant measured slower on H200, 2026-12-02.)
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
    lo = _fp4_bits_to_fp16(c, False, USE_ASM) * s_full
    hi = _fp4_bits_to_fp16(c, True, USE_ASM) * s_full
    return lo, hi


@triton.jit
def _grouped_w4a4_kernel(
    a_ptr,
    as_ptr,
    r_ptr,
    rs_ptr,
    asdec_ptr,
    w_ptr,
    ws_ptr,
    wsdec_ptr,
    rmask_ptr,
    tmap_ptr,
    arows_ptr,
    y_ptr,
    N,
    rmask_estride,
    wsdec_stride,
    K: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_AROWS: tl.constexpr,
    USE_ASM: tl.constexpr,
    A_OPERAND: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    pid = tl.program_id(1)  # N tiles vary fastest: a row tile's activations are re-read from L2, not HBM
    e = tl.load(tmap_ptr + pid * 4)  # this row tile's expert, first row and the expert's row end (tile_map)
    if e < 0:
        return
    row_end = tl.load(tmap_ptr + pid * 4 + 2)
    rows = tl.load(tmap_ptr + pid * 4 + 1) + tl.arange(0, BM)
    rmask = rows < row_end
    rows64 = rows.to(tl.int64)
    if HAS_AROWS:  # grouped row -> activation row (e.g. its token: the operand is made once per token)
        arows64 = tl.load(arows_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        arows64 = rows64
    ncols = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = ncols < N
    wrow = e.to(tl.int64) * N + ncols.to(tl.int64)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        w_lo, w_hi = _load_decoded(w_ptr, ws_ptr, wrow, nmask, k0, K, BN, BK, USE_ASM)
        if A_OPERAND:  # pre-decoded fp16 activation operand [M, 2, K/2] (RAC already folded in)
            pa = a_ptr + arows64[:, None] * K + (k0 // 2 + tl.arange(0, BK // 2))[None, :]
            a_lo = tl.load(pa, mask=rmask[:, None], other=0.0)
            a_hi = tl.load(pa + K // 2, mask=rmask[:, None], other=0.0)
        else:
            a_lo, a_hi = _load_decoded(a_ptr, as_ptr, arows64, rmask, k0, K, BM, BK, USE_ASM)
        if HAS_RES:
            # augmented K folded into the A operand: [A | R_S] @ [W | W_S]^T == (A + R) @ W^T because
            # W_S are W's own columns; R is zero off the selection and tiles without it load nothing
            b = k0 // 16 + tl.arange(0, BK // 16)
            tile_sel = tl.max(tl.load(rmask_ptr + e * rmask_estride + b).to(tl.int32), axis=0)
            r_lo, r_hi = _load_decoded(r_ptr, rs_ptr, arows64, rmask & (tile_sel != 0), k0, K, BM, BK, USE_ASM)
            a_lo += r_lo
            a_hi += r_hi
        acc = tl.dot(a_lo, tl.trans(w_lo), acc)
        acc = tl.dot(a_hi, tl.trans(w_hi), acc)
    acc = acc * 16384.0  # undo 2^-7 on each operand (exact power of two)
    sa = tl.load(asdec_ptr + arows64, mask=rmask, other=0.0)
    sw = tl.load(wsdec_ptr + e * wsdec_stride)
    y = acc * sa[:, None] * sw
    if OUT_BF16:
        y = round_bf16(y)
    tl.store(
        y_ptr + rows64[:, None] * N + ncols[None, :], y.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :]
    )


@triton.jit
def _tile_map_chunk(offs_ptr, map_ptr, E, P, chunk, BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
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
    _tile_map_chunk(offs_ptr, map_ptr, E, P, tl.program_id(0), BM, BLOCK_E, BLOCK_P)


def tile_map(offs: torch.Tensor, block_m: int, tiles: int) -> torch.Tensor:
    """int32 [tiles, 4]: per row tile p (grouped rows of offs, int32 [E] cumulative row ends, in tiles of
    block_m), (expert, first grouped row, the expert's row end, total row tiles); expert -1 past the last
    tile. One launch; the GEMMs read their tile in one round trip instead of a binary search over experts
    (a chain of ~8 dependent loads at every CTA's start)."""
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


def stack_expert_weights(weights: list[NVFP4Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert per-tensor NVFP4 weights [N, K] -> codes u8 [E, N, K/2], scale bytes u8 [E, N, K/16], S_dec [E]."""
    codes = torch.stack([w.codes for w in weights])
    scales = torch.stack([w.block_scales.view(torch.uint8) for w in weights])
    sdec = torch.stack([w.global_decode.reshape(()) for w in weights]).float()
    return codes, scales, sdec


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


_LAST_COMPILED: list = [None]


def last_compiled():
    """The compiled kernel of the latest grouped_w4a4 launch (its .asm['ttgir'] shows the MMA used)."""
    return _LAST_COMPILED[0]


def gemm_config(rows: int, k: int) -> dict[str, int]:
    """Tiles for grouped_w4a4 from the H200 sweeps (benchmarks/probe_gemm_tiles.py and the benchmark's own,
    2026-12-02): up to ~4k grouped rows the GEMM streams weights (16-row tiles, long K steps, mma.sync);
    beyond it 64- then 128-row wgmma tiles."""

    def bk(pref: int) -> int:
        return next(b for b in (256, 128, 64, 32, 16) if b <= pref and k % b == 0)

    if rows <= 4096:
        return dict(block_m=16, block_n=128, block_k=bk(256), num_warps=4, num_stages=3)
    if rows <= 16384:
        return dict(block_m=64, block_n=128, block_k=bk(128), num_warps=4, num_stages=2)
    return dict(block_m=128, block_n=128, block_k=bk(128), num_warps=8, num_stages=2)


def grouped_w4a4(
    qa: QuantizedActivation | ActivationOperand,
    offs: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_sdec: torch.Tensor,
    res_block_mask: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    use_asm: bool | None = None,
    a_rows: torch.Tensor | None = None,
    tiles: RowTiles | None = None,
) -> torch.Tensor:
    """Grouped W4A4(+RAC) GEMM -> y [M, N] in out_dtype.

    qa: activations of all rows (rows of expert e are offs[e-1]:offs[e]): NVFP4 codes
        (QuantizedActivation, decoded in the GEMM; RAC residual added per tile) or the pre-decoded
        ActivationOperand (faster: only weights are decoded; RAC already folded in).
    w_codes/w_scales/w_sdec: stack_expert_weights output (w_sdec [E] fp32 may be a strided view, e.g.
    the gate column of a serving engine's [E, 2] weight_scale_2: read in place, nothing derived).
    res_block_mask: int8/bool [K/16] or [E, K/16] marking compensated blocks (None: every block may
    hold residual).
    a_rows: int32/int64 [M'] optional: grouped row i reads activation row a_rows[i] (e.g. its token,
    with the operand made once per token: no gathered copy); y then has M' rows. Its values must lie
    in [0, M) (not checked: that would sync with the host).
    tiles: RowTiles of offs in block_m-row tiles made beforehand (row_tiles, or the operand's .tiles);
    None: one tile_map launch here.
    """
    e_count, n, k_half = w_codes.shape
    k = k_half * 2
    a_operand = isinstance(qa, ActivationOperand)
    if a_operand and qa.order != "pairs":
        raise ValueError(f"grouped_w4a4 reads the 'pairs' operand order, not {qa.order!r} (w4a4_wgmma's)")
    m, act_k = (
        (qa.values.shape[0], qa.values.shape[2] * 2) if a_operand else (qa.x.codes.shape[0], qa.x.codes.shape[1] * 2)
    )
    if act_k != k:
        raise ValueError(f"activation K={act_k} does not match weight K={k}")
    m, offs, a_rows = grouped_rows(m, offs, a_rows, e_count, w_codes.device)
    if k % block_k:
        raise ValueError(f"K={k} must be a multiple of block_k={block_k}")
    dev = w_codes.device
    tiles = gemm_row_tiles(tiles, offs, block_m, m)
    grid = (triton.cdiv(n, block_n), tiles.table.shape[0])  # row tiles: an upper bound
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    has_res = not a_operand and qa.residual is not None
    if has_res:
        mask = (
            torch.ones(k // 16, dtype=torch.int8, device=dev)
            if res_block_mask is None
            else res_block_mask.to(device=dev, dtype=torch.int8)
        )
        estride = k // 16 if mask.dim() == 2 else 0
        r, rs = qa.residual.codes, qa.residual.block_scales.view(torch.uint8)
    else:
        mask, estride = offs, 0  # unused
        r = rs = qa.values if a_operand else qa.x.codes  # unused
    if a_operand:
        a, a_s = qa.values, qa.values  # a_s unused
    else:
        a, a_s = qa.x.codes, qa.x.block_scales.view(torch.uint8)
    if use_asm is None:  # PTX decode on a GPU; the interpreter runs the integer-op twin
        use_asm = dev.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
    _LAST_COMPILED[0] = _grouped_w4a4_kernel[grid](
        a,
        a_s,
        r,
        rs,
        (qa.global_decode if a_operand else qa.x.global_decode).reshape(-1).float(),
        w_codes,
        w_scales,
        w_sdec,
        mask,
        tiles.table,
        offs if a_rows is None else a_rows,
        y,
        n,
        estride,
        w_sdec.stride(0),
        K=k,
        HAS_RES=has_res,
        HAS_AROWS=a_rows is not None,
        USE_ASM=use_asm,
        A_OPERAND=a_operand,
        OUT_BF16=out_dtype == torch.bfloat16,
        BM=block_m,
        BN=block_n,
        BK=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_options(dev),
    )
    return y


@triton.jit
def _decode_probe(c_ptr, s_ptr, lo_ptr, hi_ptr, BR: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):
    rows = tl.arange(0, BR).to(tl.int64)
    lo, hi = _load_decoded(c_ptr, s_ptr, rows, rows < BR, 0, BK, BR, BK, USE_ASM)
    offs = rows[:, None] * (BK // 2) + tl.arange(0, BK // 2)[None, :]
    tl.store(lo_ptr + offs, lo.to(tl.float32))
    tl.store(hi_ptr + offs, hi.to(tl.float32))


def check_tile_decode(device: str | torch.device = "cpu", use_asm: bool = False) -> bool:
    """Self-check of the GEMM's in-register decode: value * s_b * 2^-7 for all 256 code bytes
    x 127 finite E4M3 scales, bit for bit (use_asm needs a CUDA device)."""
    scales = torch.arange(128, dtype=torch.uint8, device=device).clamp(max=126).reshape(128, 1).repeat(1, 16)
    ok = True
    for half in (0, 1):
        codes = torch.arange(128 * half, 128 * half + 128, dtype=torch.uint8, device=device).reshape(1, 128)
        codes = codes.repeat(128, 1).contiguous()
        lo = torch.empty(128, 128, device=device)
        hi = torch.empty(128, 128, device=device)
        _decode_probe[(1,)](codes, scales.contiguous(), lo, hi, BR=128, BK=256, USE_ASM=use_asm)
        one = torch.tensor(1.0, device=device)
        want = nvfp4.dequantize(NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), one)) / 128
        ok &= torch.equal(lo, want[:, 0::2]) and torch.equal(hi, want[:, 1::2])
    return bool(ok)
