"""Host side of the Gluon Hopper grouped W4A4 GEMM (device code: gemm_wgmma): where it runs, its launch
constants, and grouped_w4a4_wgmma, which checks a tile (tile_configs.WgmmaConfig; tuned defaults from
configs/wgmma_gemm.json) against the shape, launches it and checks each compiled variant's SASS for
wgmma register hazards once (sass_check): a form that keeps a wgmma in flight under the next decode
falls back to the safe form where the check finds a hazard or cannot read the SASS.
"""

from __future__ import annotations

import functools
import subprocess
import warnings

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quads_megatron.errors import KernelConfigError
from quads_megatron.kernels import pdl
from quads_megatron.kernels.act_quant import WGMMA_CHUNK, check_wgmma_order
from quads_megatron.kernels.gemm_wgmma import (
    ROWS_PER_WARPGROUP,
    codes_layout,
    w4a4_wgmma_kernel,
    w4a4_wgmma_ws_kernel,
    y_box_layout,
)
from quads_megatron.kernels.row_tiles import RowTiles, gemm_ctas, gemm_row_tiles, grouped_rows
from quads_megatron.kernels.sass_check import disassemble, wgmma_register_hazards
from quads_megatron.kernels.tile_configs import WgmmaConfig, wgmma_config
from quads_megatron.kernels.weight_layout import weight_dims

CHUNK = WGMMA_CHUNK  # K elements per k-step and per operand permutation chunk


def operand_permutation(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [K]: position L of the "wgmma" operand holds activation element perm[L].

    Inside each 128-chunk, with physical bits P = (t1 t0 w1 w0 q1 q0 s) (code byte 16t + 4w + q of
    a row, s = high nibble), the logical position is L = (w1 w0 s q1 t1 t0 q0): the order in which
    the decode's registers reach wgmma's A fragment (rows g, g+8; k 2t, 2t+1, 2t+8, 2t+9 per k16).
    """
    check_wgmma_order(k)
    p = torch.arange(CHUNK)
    bit = [(p >> i) & 1 for i in range(7)]  # p0 = s, p1 = q0, p2 = q1, p3 = w0, p4 = w1, p5 = t0, p6 = t1
    logical = (bit[4] << 6) | (bit[3] << 5) | (bit[0] << 4) | (bit[2] << 3) | (bit[6] << 2) | (bit[5] << 1) | bit[1]
    inv = torch.empty(CHUNK, dtype=torch.int64)
    inv[logical] = p
    return (torch.arange(0, k, CHUNK)[:, None] + inv[None, :]).reshape(-1).to(device)


@functools.cache
def _capability_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def usable(device: torch.device, n: int, k: int) -> bool:
    """Whether this kernel runs for weights [N, K] on device: an sm_90 GPU, K % 128 == 0, K >= 256 (a
    one-step K loop does not lower), N % 64 == 0."""
    if device.type != "cuda" or k % CHUNK or k < 2 * CHUNK or n % ROWS_PER_WARPGROUP:
        return False
    return _capability_ok(device.index if device.index is not None else torch.cuda.current_device())


def ws_loader_regs(block_t: int, loader_warps: int, chunks: int = 1, cta_rows: int = 128) -> int:
    """Registers per thread of the loader warps: one int32 offset per 16-byte activation copy (BT * 16 /
    (32 * loader_warps) per thread) plus the code and scale offsets, and a second chunk's bases (8 more
    but at 5-8 copies), 8 more for 192 weight rows (copied in 64-row pieces); without spills outside the
    register handoff (sass_check.compile_wgmma_sm90)."""
    copies = block_t * 16 // (32 * loader_warps)
    regs = (40 if copies <= 4 else 48 if copies <= 8 else 88) + (8 if chunks == 2 and copies not in range(5, 9) else 0)
    return regs + (8 if cta_rows == 192 else 0)


def ws_consumer_regs(maxnreg: int | None, loader_warps: int, loader_regs: int, consumer_warps: int = 8) -> int:
    """Registers per thread of the second (and third) consumer warpgroup of a split warp-specialized launch: an
    equal share (a multiple of 8) of what the launch's cap leaves after the loader; the first warpgroup gets the
    rest. Without a cap, the register file of one CTA per SM."""
    threads = 32 * (consumer_warps + loader_warps)
    budget = (maxnreg or 65536 // threads // 8 * 8) * threads - 32 * loader_warps * loader_regs
    return budget // (32 * consumer_warps) // 8 * 8


def ws_launch_consts(
    block_t: int, num_warps: int, chunks: int, loader_warps: int, maxnreg: int | None, split: bool
) -> dict:
    """The warp-specialized kernel's launch constants that follow from its tile: loader warps and their
    registers, split consumers and the second warpgroup's registers, the code layout of one consumer
    partition and the launch's warps (split: the first consumer warpgroup's; the second one and the
    loader are workers)."""
    loader_regs = ws_loader_regs(block_t, loader_warps, chunks, ROWS_PER_WARPGROUP * num_warps // 4)
    partition_warps = 4 if split else num_warps
    return dict(
        LW=loader_warps,
        LOADER_REGS=loader_regs,
        SPLIT=split,
        CONSUMER_REGS=ws_consumer_regs(maxnreg, loader_warps, loader_regs, num_warps) if split else 0,
        CODES_LAYOUT=codes_layout(partition_warps),
        num_warps=partition_warps,
    )


def ws_overlap(chunks: int, unroll: int) -> bool:
    """Whether the warp-specialized kernel (1-step runs) keeps a slot's first chunk's wgmma in flight under
    the second one's decode: asked for by unroll > 1, possible with 2 chunks per slot."""
    return chunks == 2 and unroll > 1


def run_length(k: int, chunks: int, unroll: int) -> int:
    """k-steps per straight-line run: the largest divisor of the K loop's steps that is <= unroll and
    leaves at least two runs (a single-run loop does not lower)."""
    steps = k // (CHUNK * chunks)
    return max(d for d in range(1, max(1, min(unroll, steps // 2)) + 1) if steps % d == 0)


def fit_tile(cfg: WgmmaConfig, n: int, k: int, out_dtype: torch.dtype) -> tuple[int, int, bool]:
    """The tile as it runs on weights [N, K] with this output dtype: (chunks per step: 1 where K does not
    allow 2, or allows only a one-step loop with loader warps; k-steps per run, run_length, 1 with loader
    warps; in-slot overlap). KernelConfigError where the tile cannot run there: N not a multiple of its
    CTA's weight rows, too few stages for its runs, TMA stores of a non-2-byte output."""
    chunks = cfg.chunks
    if k % (CHUNK * chunks) or (cfg.loader_warps and k // (CHUNK * chunks) < 2):  # a 1-step K loop does not lower
        chunks = 1
    overlap = bool(cfg.loader_warps) and ws_overlap(chunks, cfg.unroll)
    unroll = 1 if cfg.loader_warps else run_length(k, chunks, cfg.unroll)
    min_stages = 2 if unroll == 1 else 3  # at least one k-step in flight ahead (see AHEAD in the kernel)
    bad_n = n % (ROWS_PER_WARPGROUP * cfg.num_warps // 4)
    if bad_n or cfg.stages < min_stages or (cfg.tma_store and out_dtype.itemsize != 2):
        raise KernelConfigError(
            f"bad wgmma tiles for N={n}, K={k}, {out_dtype}: num_warps={cfg.num_warps} (N % (16 * warps) == 0), "
            f"stages={cfg.stages} (>= {min_stages} with {unroll}-step runs), tma_store={cfg.tma_store} "
            "(a 2-byte output only)"
        )
    return chunks, unroll, overlap


_SASS_CHECKED: dict[str, list[str] | None] = {}  # compiled kernel hash -> hazards (None: SASS unreadable)
_ONE_STEP_RUNS: set[tuple] = set()  # tiles whose multi-step runs (or in-slot overlap) were unsafe or unverifiable


def _register_hazards(kernel) -> list[str] | None:
    """wgmma_register_hazards of a compiled kernel, once per compiled variant (a disassembly takes up to
    a second); None where its SASS cannot be read (disassemble: the cuobjdump Triton bundles)."""
    key = getattr(kernel, "hash", None) or str(id(kernel))
    if key not in _SASS_CHECKED:
        try:
            sass = disassemble(kernel.asm["cubin"])
        except (OSError, RuntimeError, subprocess.CalledProcessError):
            sass = None
        _SASS_CHECKED[key] = None if sass is None else wgmma_register_hazards(sass)
    return _SASS_CHECKED[key]


def grouped_w4a4_wgmma(
    values: torch.Tensor,
    global_decode: torch.Tensor,
    offs: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_sdec: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    a_rows: torch.Tensor | None = None,
    config: WgmmaConfig | None = None,
    tiles: RowTiles | None = None,
) -> torch.Tensor:
    """y [rows, N] = S_dec_a * S_dec_w[e] * (A @ W_e^T) for the grouped rows of offs (see gemm_triton.grouped_w4a4).

    values: fp16 [M, K] activation operand in the "wgmma" order; global_decode: fp32 [M] or [M, 1]; w_codes u8
    [E, N, K/2], w_scales u8 [E, N, K/16] (or both tiled: weight_layout), w_sdec fp32 [E] (may be strided);
    a_rows: optional token index of each grouped row. config: the tiles (None: the tuned ones,
    wgmma_config(rows, N, out_dtype, k=K)); where K does not allow 2 chunks per step (K % 256, or a one-step
    loop with loader warps) one is used, and runs are shortened to a divisor of the K loop (run_length).
    tiles: RowTiles of offs in block_t-row tiles made beforehand (row_tiles.row_tiles, or the activation
    operand's .tiles); None: one tile_map launch.

    Each compiled variant's SASS is checked once (sass_check): multi-step runs or in-slot overlap whose
    wgmma register operand could be rewritten in flight (or whose SASS cannot be read) fall back to the
    safe form, with a warning; a hazard there too raises RuntimeError.
    """
    e_count, n, k, tiled = weight_dims(w_codes, w_scales)
    if values.dim() != 2 or values.shape[1] != k or values.dtype != torch.float16:
        raise ValueError(f"wgmma operand must be fp16 [M, {k}], got {values.dtype} {tuple(values.shape)}")
    if not usable(w_codes.device, n, k):
        raise ValueError(
            f"the Hopper wgmma GEMM needs an sm_90 GPU, K % 128 == 0, K >= 256 and N % 64 == 0 (N={n}, K={k})"
        )
    if config is not None and not isinstance(config, WgmmaConfig):
        raise TypeError(f"config must be a WgmmaConfig, got {type(config).__name__}")
    m, offs, a_rows = grouped_rows(values.shape[0], offs, a_rows, e_count, w_codes.device)
    cfg = config or wgmma_config(m, n, out_dtype, w_codes.device, k=k)
    chunks, unroll, overlap = fit_tile(cfg, n, k, out_dtype)
    block_t, num_warps, stages, loader_warps = cfg.block_t, cfg.num_warps, cfg.stages, cfg.loader_warps
    maxnreg, split, mask_rows, narrow, tma_store = cfg.maxnreg, cfg.split, cfg.mask_rows, cfg.narrow, cfg.tma_store
    dev = w_codes.device
    tiles = gemm_row_tiles(tiles, offs, block_t, m)
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    grid = (n // (ROWS_PER_WARPGROUP * num_warps // 4), tiles.table.shape[0])  # row tiles: an upper bound
    args = (
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
    )
    consts = dict(K=k, HAS_AROWS=a_rows is not None, BT=block_t, MASK_ROWS=mask_rows, TILED=tiled)
    consts.update(STAGES=stages, NW=num_warps, CODES_LAYOUT=codes_layout(num_warps), num_warps=num_warps)
    consts.update(pdl.launch_options(dev))
    if maxnreg:
        consts["maxnreg"] = maxnreg
    if loader_warps:
        staged = bool(cfg.ctas_per_sm)  # persistent CTAs stage the epilogue's scales
        consts.update(KC=chunks, A_I64=values.shape[0] * k >= 2**31, NARROW=narrow, STAGED=staged)
        consts.update(L2_AHEAD=cfg.l2_prefetch)
        consts.update(ws_launch_consts(block_t, num_warps, chunks, loader_warps, maxnreg, split))
        tiles_ub = grid[0] * grid[1]  # row tiles are known on the device only: their upper bound
        p = gemm_ctas(tiles_ub, dev, cfg.ctas_per_sm)
        tile = ("ws", k, a_rows is not None, block_t, stages, num_warps, loader_warps, maxnreg, out_dtype)
        tile += (split, mask_rows, narrow, staged, tma_store, tiled, cfg.l2_prefetch)
        y_desc = TensorDescriptor.from_tensor(y, [block_t, 64], y_box_layout(block_t)) if tma_store else None
        ws_args = (*args[:8], y_desc, *args[8:], p)
        _launch_verified(
            lambda risky: w4a4_wgmma_ws_kernel[(p,)](*ws_args, OVERLAP=risky, **consts),
            overlap,
            tile,
            "in-slot overlap",
            "retiring each chunk",
        )
        return y
    consts["KC"] = chunks
    tile = (k, a_rows is not None, block_t, stages, chunks, num_warps, maxnreg, out_dtype, unroll, mask_rows, tiled)
    _launch_verified(
        lambda risky: w4a4_wgmma_kernel[grid](*args, UNROLL=unroll if risky else 1, **consts),
        unroll > 1,
        tile,
        f"{unroll}-step runs",
        "using 1-step runs",
    )
    return y


def _launch_verified(launch, risky: bool, tile: tuple, what: str, safe: str) -> None:
    """launch(risky) -> the compiled kernel, its SASS checked (sass_check). risky: the form that keeps
    a wgmma in flight under the next decode (multi-step runs, in-slot overlap). Where that form shows a
    register hazard or its SASS cannot be read: warn, remember the tile (never risky again) and relaunch
    the safe form; a hazard there raises RuntimeError rather than return a wrong tile."""
    risky = risky and tile not in _ONE_STEP_RUNS
    found = _register_hazards(launch(risky))
    if risky and found != []:
        why = "its SASS could not be read" if found is None else f"{len(found)} register hazards"
        warnings.warn(f"Gluon GEMM: {what} not verified ({why}); {safe}", stacklevel=3)
        _ONE_STEP_RUNS.add(tile)
        found = _register_hazards(launch(False))
    if found:
        raise RuntimeError(f"wgmma register hazard in the compiled Gluon GEMM (sass_check): {found[:3]}")
