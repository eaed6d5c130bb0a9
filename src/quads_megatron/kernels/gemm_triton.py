"""Grouped W4A4(+RAC) GEMM in Triton: y[rows of expert e] = S_dec_x * S_dec_w[e] * ([A | R_S] @ [W_e | W_e,S]^T).

FP4 codes are decoded in registers to fp16 (fp4_device.load_decoded: value * E4M3 scale * 2^-7 is
exact in fp16), products run on the fp16 tensor cores, sums accumulate in fp32. Because W_S are W's
own columns (same codes and scales), the augmented-K product is computed as (A + R) @ W^T with the
residual added to the decoded activation tile: no extra MMA and no extra weight traffic. A + R is
exact in fp16 unless the two terms span more than 11 bits (then it rounds at 2^-11 relative); without
RAC every product is exact. Expert rows follow offs (cumulative row ends, as torch._grouped_mm); tiles
come from a row-tile table (row_tiles.RowTiles); rows may read their activation through an index
(a_rows). Tiles: tile_configs.TritonGemmConfig, tuned defaults from configs/triton_gemm.json.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quads_megatron.kernels import pdl
from quads_megatron.kernels.act_quant import ActivationOperand
from quads_megatron.kernels.fp4_device import load_decoded, round_bf16
from quads_megatron.kernels.pdl import wait_then_release
from quads_megatron.kernels.row_tiles import RowTiles, gemm_row_tiles, grouped_rows
from quads_megatron.kernels.tile_configs import TritonGemmConfig, triton_gemm_config
from quads_megatron.kernels.weight_layout import weight_dims
from quads_megatron.nvfp4 import NVFP4Tensor
from quads_megatron.rollout.rac_plan import QuantizedActivation


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
    TILED: tl.constexpr = False,
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
        w_lo, w_hi = load_decoded(w_ptr, ws_ptr, wrow, nmask, k0, K, BN, BK, USE_ASM, TILED)
        if A_OPERAND:  # pre-decoded fp16 activation operand [M, 2, K/2] (RAC already folded in)
            pa = a_ptr + arows64[:, None] * K + (k0 // 2 + tl.arange(0, BK // 2))[None, :]
            a_lo = tl.load(pa, mask=rmask[:, None], other=0.0)
            a_hi = tl.load(pa + K // 2, mask=rmask[:, None], other=0.0)
        else:
            a_lo, a_hi = load_decoded(a_ptr, as_ptr, arows64, rmask, k0, K, BM, BK, USE_ASM)
        if HAS_RES:
            # augmented K folded into the A operand: [A | R_S] @ [W | W_S]^T == (A + R) @ W^T because
            # W_S are W's own columns; R is zero off the selection and tiles without it load nothing
            b = k0 // 16 + tl.arange(0, BK // 16)
            tile_sel = tl.max(tl.load(rmask_ptr + e * rmask_estride + b).to(tl.int32), axis=0)
            r_lo, r_hi = load_decoded(r_ptr, rs_ptr, arows64, rmask & (tile_sel != 0), k0, K, BM, BK, USE_ASM)
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


def stack_expert_weights(weights: list[NVFP4Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert per-tensor NVFP4 weights [N, K] -> codes u8 [E, N, K/2], scale bytes u8 [E, N, K/16],
    S_dec [E]: the layout both grouped GEMMs read."""
    codes = torch.stack([w.codes for w in weights])
    scales = torch.stack([w.block_scales.view(torch.uint8) for w in weights])
    sdec = torch.stack([w.global_decode.reshape(()) for w in weights]).float()
    return codes, scales, sdec


_LAST_COMPILED: list = [None]


def last_compiled():
    """The compiled kernel of the latest grouped_w4a4 launch (its .asm['ttgir'] shows the MMA used)."""
    return _LAST_COMPILED[0]


def grouped_w4a4(
    qa: QuantizedActivation | ActivationOperand,
    offs: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_sdec: torch.Tensor,
    res_block_mask: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: TritonGemmConfig | None = None,
    use_asm: bool | None = None,
    a_rows: torch.Tensor | None = None,
    tiles: RowTiles | None = None,
) -> torch.Tensor:
    """Grouped W4A4(+RAC) GEMM -> y [M, N] in out_dtype.

    qa: activations of all rows (rows of expert e are offs[e-1]:offs[e]): NVFP4 codes
        (QuantizedActivation, decoded in the GEMM; RAC residual added per tile) or the pre-decoded
        ActivationOperand in the "pairs" order (faster: only weights are decoded; RAC already folded in).
    w_codes/w_scales/w_sdec: stack_expert_weights output, codes and scales row-major or both tiled
    (weight_layout.tile_weights; N % 16 == 0, K % 128 == 0) (w_sdec [E] fp32 may be a strided view, e.g.
    the gate column of a serving engine's [E, 2] weight_scale_2: read in place, nothing derived).
    res_block_mask: int8/bool [K/16] or [E, K/16] marking compensated blocks (None: every block may
    hold residual).
    config: the tiles (None: the tuned ones for this many grouped rows and K, triton_gemm_config).
    use_asm: PTX decode (None: on a GPU, not under the interpreter).
    a_rows: int32/int64 [M'] optional: grouped row i reads activation row a_rows[i] (e.g. its token,
    with the operand made once per token: no gathered copy); y then has M' rows. Its values must lie
    in [0, M) (not checked: that would sync with the host).
    tiles: RowTiles of offs in block_m-row tiles made beforehand (row_tiles, or the operand's .tiles);
    None: one tile_map launch here.
    """
    e_count, n, k, tiled = weight_dims(w_codes, w_scales)
    a_operand = isinstance(qa, ActivationOperand)
    if a_operand and qa.order != "pairs":
        raise ValueError(f"grouped_w4a4 reads the 'pairs' operand order, not {qa.order!r} (the wgmma GEMM's)")
    if config is not None and not isinstance(config, TritonGemmConfig):
        raise TypeError(f"config must be a TritonGemmConfig, got {type(config).__name__}")
    m, act_k = (
        (qa.values.shape[0], qa.values.shape[2] * 2) if a_operand else (qa.x.codes.shape[0], qa.x.codes.shape[1] * 2)
    )
    if act_k != k:
        raise ValueError(f"activation K={act_k} does not match weight K={k}")
    m, offs, a_rows = grouped_rows(m, offs, a_rows, e_count, w_codes.device)
    dev = w_codes.device
    cfg = config or triton_gemm_config(m, k, dev)
    if k % cfg.block_k:
        raise ValueError(f"K={k} must be a multiple of block_k={cfg.block_k}")
    tiles = gemm_row_tiles(tiles, offs, cfg.block_m, m)
    grid = (triton.cdiv(n, cfg.block_n), tiles.table.shape[0])  # row tiles: an upper bound
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
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        TILED=tiled,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.launch_options(dev),
    )
    return y
