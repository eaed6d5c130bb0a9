"""The experts' NVFP4 weights in the two layouts the grouped GEMMs read.

Row-major: codes u8 [E, N, K/2], scale bytes u8 [E, N, K/16] (the checkpoint's and SGLang's). Tiled:
codes [E, N/16, K/128, 16, 64], scales [E, N/16, K/128, 16, 8]: each 16-row group's 128-K chunk is one
contiguous block (1 KB of codes, 128 B of scales), so a warp's loads of a chunk read 512 contiguous bytes,
not 64 bytes from each of 16 rows K/2 bytes apart. The same bytes in another order: the same products.
"""

from __future__ import annotations

import torch

TILE_ROWS = 16  # weight rows per block
CHUNK_K = 128  # K elements per block: 64 code bytes and 8 scale bytes per row


def tile_weights(w_codes: torch.Tensor, w_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major codes [E, N, K/2] and scales [E, N, K/16] -> the tiled layout (new contiguous tensors)."""
    e, n, k_half = w_codes.shape
    if n % TILE_ROWS or (2 * k_half) % CHUNK_K or tuple(w_scales.shape) != (e, n, k_half // 8):
        raise ValueError(
            f"tile_weights needs codes [E, N, K/2] and scales [E, N, K/16] with N % {TILE_ROWS} == 0 and "
            f"K % {CHUNK_K} == 0, got {tuple(w_codes.shape)} / {tuple(w_scales.shape)}"
        )
    kch = 2 * k_half // CHUNK_K
    codes = w_codes.reshape(e, n // TILE_ROWS, TILE_ROWS, kch, 64).permute(0, 1, 3, 2, 4).contiguous()
    scales = w_scales.reshape(e, n // TILE_ROWS, TILE_ROWS, kch, 8).permute(0, 1, 3, 2, 4).contiguous()
    return codes, scales


def untile_weights(w_codes: torch.Tensor, w_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tile_weights' inverse: tiled codes and scales -> row-major [E, N, K/2] / [E, N, K/16] (new tensors)."""
    e, n, k, _ = weight_dims(w_codes, w_scales)
    codes = w_codes.permute(0, 1, 3, 2, 4).reshape(e, n, k // 2)
    scales = w_scales.permute(0, 1, 3, 2, 4).reshape(e, n, k // 16)
    return codes, scales


def weight_dims(w_codes: torch.Tensor, w_scales: torch.Tensor) -> tuple[int, int, int, bool]:
    """(E, N, K, tiled) of row-major or tiled weights; ValueError for tiled tensors of the wrong shape or not
    contiguous (the kernels address them as dense blocks)."""
    if w_codes.dim() == 5:
        e, n16, kch, rows, nbytes = w_codes.shape
        if (rows, nbytes) != (TILE_ROWS, 64) or tuple(w_scales.shape) != (e, n16, kch, TILE_ROWS, 8):
            got = f"{tuple(w_codes.shape)} / {tuple(w_scales.shape)}"
            raise ValueError(f"tiled weights must be [E, N/16, K/128, 16, 64] / [..., 16, 8], got {got}")
        if not (w_codes.is_contiguous() and w_scales.is_contiguous()):
            raise ValueError("tiled weights must be contiguous")
        return e, TILE_ROWS * n16, CHUNK_K * kch, True
    if w_codes.dim() != 3:
        got = tuple(w_codes.shape)
        raise ValueError(f"weights must be codes [E, N, K/2] or tiled [E, N/16, K/128, 16, 64], got {got}")
    e, n, k_half = w_codes.shape
    return e, n, 2 * k_half, False
