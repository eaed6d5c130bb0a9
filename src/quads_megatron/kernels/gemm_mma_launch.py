"""Host side of the decode-size Gluon GEMM (device code: gemm_mma): where it runs, its layouts and
grouped_w4a4_mma, which checks a tile (tile_configs.MmaConfig; tuned defaults from configs/mma_gemm.json)
against the shape and launches it."""

from __future__ import annotations

import dataclasses
import functools

import torch

from quads_megatron.errors import KernelConfigError
from quads_megatron.kernels import pdl
from quads_megatron.kernels.gemm_mma import (
    CHUNK_K,
    activation_layout,
    codes16_layout,
    codes_layout,
    w4a4_mma_kernel,
    words_layout,
)
from quads_megatron.kernels.row_tiles import RowTiles, gemm_ctas, gemm_row_tiles, grouped_rows
from quads_megatron.kernels.tile_configs import MmaConfig, mma_config
from quads_megatron.kernels.weight_layout import weight_dims


@functools.cache
def _capability_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)  # the scale bytes' E4M3 -> fp16 cvt


def usable(device: torch.device, n: int, k: int) -> bool:
    """Whether this kernel can run for weights [N, K] on device: a CUDA GPU of sm_89 or later, K % 128 == 0,
    N % 64 == 0 (the smallest CTA: 4 warps of 16 weight rows)."""
    if device.type != "cuda" or k % CHUNK_K or n % 64:
        return False
    return _capability_ok(device.index if device.index is not None else torch.cuda.current_device())


def fit_rows(cfg: MmaConfig, n: int) -> MmaConfig:
    """A tuned tile narrowed until its CTA's weight rows divide N (fewer row groups, then 4 warps; N % 64 == 0
    always fits 4 warps of one group): the data file's tile serves every N the kernel runs."""
    while n % (16 * cfg.num_warps * cfg.row_groups):
        cfg = dataclasses.replace(cfg, row_groups=1) if cfg.row_groups > 1 else dataclasses.replace(cfg, num_warps=4)
    return cfg


def fit_tile(cfg: MmaConfig, n: int, k: int) -> int:
    """Chunks per k-step as the tile runs on weights [N, K]: the tile's, or the largest of its chunk_choices()
    below it that divides K's chunks. KernelConfigError where N is not a multiple of the CTA's weight rows."""
    rows = 16 * cfg.num_warps * cfg.row_groups
    if n % rows:
        raise KernelConfigError(
            f"bad mma tiles for N={n}: num_warps={cfg.num_warps} x row_groups={cfg.row_groups} x 16 rows must divide N"
        )
    return max(c for c in cfg.chunk_choices() if c <= cfg.chunks and (k // CHUNK_K) % c == 0)


def grouped_w4a4_mma(
    values: torch.Tensor,
    global_decode: torch.Tensor,
    offs: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_sdec: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    a_rows: torch.Tensor | None = None,
    config: MmaConfig | None = None,
    tiles: RowTiles | None = None,
) -> torch.Tensor:
    """y [rows, N] = S_dec_a * S_dec_w[e] * (A @ W_e^T) for the grouped rows of offs (see gemm_triton.grouped_w4a4).

    values: fp16 [M, 2, K/2] activation operand in the "pairs" order (act_quant; RAC folded in);
    global_decode: fp32 [M] or [M, 1]; w_codes u8 [E, N, K/2], w_scales u8 [E, N, K/16] (or both tiled:
    weight_layout), w_sdec fp32 [E] (may be strided); a_rows: optional token index of each grouped
    row (values in [0, M), not checked: that would sync). config: the tiles (None: mma_config(rows, K), narrowed
    to N by fit_rows). tiles: RowTiles of offs in block_t-row tiles made beforehand (the activation operand's
    .tiles); None: one tile_map launch.
    """
    e_count, n, k, tiled = weight_dims(w_codes, w_scales)
    k_half = k // 2
    if values.dim() != 3 or values.shape[1:] != (2, k_half) or values.dtype != torch.float16:
        raise ValueError(f"mma operand must be fp16 [M, 2, {k_half}] (pairs), got {values.dtype} {tuple(values.shape)}")
    if not usable(w_codes.device, n, k):
        raise ValueError(f"the mma GEMM needs a CUDA GPU (sm_89+), K % 128 == 0 and N % 64 == 0 (N={n}, K={k})")
    if config is not None and not isinstance(config, MmaConfig):
        raise TypeError(f"config must be an MmaConfig, got {type(config).__name__}")
    m, offs, a_rows = grouped_rows(values.shape[0], offs, a_rows, e_count, w_codes.device)
    cfg = config or fit_rows(mma_config(m, k, w_codes.device), n)  # a given tile must fit as it is
    chunks = fit_tile(cfg, n, k)
    dev = w_codes.device
    tiles = gemm_row_tiles(tiles, offs, cfg.block_t, m)
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    nw, rg = cfg.num_warps, cfg.row_groups
    grid = (n // (16 * nw * rg), tiles.table.shape[0])  # row tiles: an upper bound
    p = gemm_ctas(grid[0] * grid[1], dev, cfg.ctas_per_sm)
    if cfg.ctas_per_sm:  # persistent CTAs over the live tiles
        grid = (p,)
    w4a4_mma_kernel[grid](
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
        p,
        K=k,
        HAS_AROWS=a_rows is not None,
        BT=cfg.block_t,
        NW=nw,
        RG=rg,
        KC=chunks,
        CODES_LAYOUT=codes_layout(nw, rg),
        X_LAYOUT=activation_layout(nw, cfg.block_t),
        C16_LAYOUT=codes16_layout(nw, rg),
        PREFETCH=cfg.prefetch,
        WEIGHT_LOADS=cfg.weight_loads,
        WORDS_LAYOUT=words_layout(nw, rg),
        TILED=tiled,
        WEIGHTS_FIRST=cfg.weights_first,
        L2_AHEAD=cfg.l2_prefetch,
        PERSIST=cfg.ctas_per_sm > 0,
        num_warps=nw,
        **pdl.launch_options(dev),
    )
    return y
