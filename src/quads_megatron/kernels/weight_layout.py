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


#: bytes of one row's 128-K chunk: codes (2 per byte) and E4M3 scale bytes (one per 16)
CODE_CHUNK_BYTES, SCALE_CHUNK_BYTES = CHUNK_K // 2, CHUNK_K // 16


def scratch_bytes(x: torch.Tensor, max_bytes: int) -> int:
    """Bytes of the scratch buffer retile_ uses for x [E, N, B]: whole slabs, at most max_bytes (at least one)."""
    slab = x[0].numel() * x.element_size() if x.shape[0] else 0
    return slab * max(1, min(x.shape[0], max_bytes // max(slab, 1)))


def retile_(
    x: torch.Tensor,
    chunk_bytes: int,
    *,
    tiled: bool,
    first: int = 0,
    count: int | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """Reorder experts first .. first+count of x in place, to the tiled layout (tiled=True) or back.

    x: a contiguous tensor of 1-byte elements [E, N, B] whatever its layout (the parameter's shape: codes
    with chunk_bytes CODE_CHUNK_BYTES, scale bytes with SCALE_CHUNK_BYTES); each expert's slab alone is
    permuted, so the storage never moves (CUDA graphs keep their pointers). scratch: a u8 buffer of whole
    slabs (default: scratch_bytes(x, 64 MiB)), allocated by the caller before any write when a failed
    allocation must leave x as it was.
    """
    e, n, b = x.shape
    count = e - first if count is None else count
    if x.element_size() != 1 or not x.is_contiguous() or n % TILE_ROWS or b % chunk_bytes:
        raise ValueError(
            f"retile_ needs a contiguous 1-byte [E, N, B] tensor with N % {TILE_ROWS} == 0 and B % {chunk_bytes} "
            f"== 0, got {x.dtype} {tuple(x.shape)}"
        )
    if not 0 <= first <= first + count <= e:
        raise ValueError(f"retile_: experts {first} .. {first + count} are not within 0 .. {e}")
    slab = n * b
    scratch = (
        torch.empty(scratch_bytes(x, 64 << 20), dtype=torch.uint8, device=x.device) if scratch is None else scratch
    )
    group = scratch.numel() // slab
    if group < 1:
        raise ValueError(f"retile_: scratch of {scratch.numel()} bytes is smaller than one expert's {slab}")
    u = x.view(torch.uint8)
    # row-major slab = [N/16, 16, B/c, c]; tiled slab = [N/16, B/c, 16, c]: the same swap both ways
    src_dims = (TILE_ROWS, b // chunk_bytes) if tiled else (b // chunk_bytes, TILE_ROWS)
    for start in range(first, first + count, group):
        k = min(group, first + count - start)
        part = u[start : start + k]
        staged = scratch[: k * slab].view(k, n // TILE_ROWS, src_dims[1], src_dims[0], chunk_bytes)
        staged.copy_(part.view(k, n // TILE_ROWS, *src_dims, chunk_bytes).permute(0, 1, 3, 2, 4))
        part.view(-1).copy_(staged.view(-1))


def tiled_view(x: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """The tiled 5-D view [E, N/16, B/chunk, 16, chunk] of a contiguous [E, N, B] tensor whose slabs hold
    tiled bytes (retile_): the shape the kernels take, no copy."""
    e, n, b = x.shape
    return x.view(e, n // TILE_ROWS, b // chunk_bytes, TILE_ROWS, chunk_bytes)
