"""Device probe: how fast can a CTA ring stream the fc1 weights of the Qwen3-30B-A3B MoE layer?

python dev/probe_load_paths.py [--sets decode,prefill]
(CUDA GPU; CUDA-graph replay medians)

The warp-specialized GEMM (kernels/gemm_wgmma.py) spends most of its time in its load path
(docs/kernel-notes.md). This probe isolates it: a loader partition copies per k-step a [BNW rows, CB
bytes] tile of the NVFP4 codes (plus the scale bytes and BT activation rows of fp16 when asked)
into a ring, the consumer warps only wait for each slot and free it. Nothing is computed.

Modes of fetching the code tile:
  rows - cp.async, CB bytes of each of BNW rows of the [E*N, K/2] codes (what the GEMM does, CB = 64);
  flat - cp.async, the same bytes laid out as one contiguous BNW*CB block per k-step (a pre-tiled copy);
  tma  - one TMA box [BNW, CB] of the [E*N, K/2] codes per k-step (one thread issues it).
Each line: GB/s of the bytes moved (codes + scales + activation rows); the HBM read floor is ~4 TB/s.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# this directory, for the probes' shared setup
sys.path.append(os.path.dirname(__file__))
from probe_wgmma_tiles import HIDDEN, INTER, E, bench  # noqa: E402

N = gl.constexpr(2 * INTER)  # fc1's weight rows per expert (gate and up)
MODES = {"rows": 0, "flat": 1, "tma": 2}


@gluon.jit
def _loader(
    w_src,
    s_ptr,
    a_ptr,
    w_smem,
    s_smem,
    a_smem,
    ready,
    empty,
    P,
    n_tiles,
    ROW_BYTES: gl.constexpr,
    MODE: gl.constexpr,
    SCALES: gl.constexpr,
    BNW: gl.constexpr,
    CB: gl.constexpr,
    BT: gl.constexpr,
    LW: gl.constexpr,
):
    """LW warps (w_src: the codes' pointer, or their TMA descriptor in mode 2): per tile (BNW weight
    rows) and k-step (CB code bytes per row), copy the code tile, the scale bytes (CB / 8 per row) and
    BT activation rows (2 * CB fp16 each) into the next free slot."""
    STAGES: gl.constexpr = w_smem.shape[0]
    TPC: gl.constexpr = CB // 16
    w_copy: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPC, TPC], [LW, 1], [1, 0])
    wr = gl.arange(0, BNW, layout=gl.SliceLayout(1, w_copy))[:, None]
    wc = gl.arange(0, CB, layout=gl.SliceLayout(0, w_copy))[None, :]
    if MODE == 1:
        w_off = wr * CB + wc
    else:
        w_off = wr * ROW_BYTES + wc
    s_copy: gl.constexpr = gl.BlockedLayout([1, CB // 8], [32, 1], [LW, 1], [1, 0])
    s_off = (
        gl.arange(0, BNW, layout=gl.SliceLayout(1, s_copy))[:, None] * (ROW_BYTES // 8)
        + gl.arange(0, CB // 8, layout=gl.SliceLayout(0, s_copy))[None, :]
    )
    AC: gl.constexpr = 2 * CB  # activation elements per row per k-step
    TPA: gl.constexpr = AC // 8 if AC // 8 < 32 else 32
    a_copy: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPA, TPA], [LW, 1], [1, 0])
    BTA: gl.constexpr = BT if BT > 0 else 1
    a_off = (
        gl.arange(0, BTA, layout=gl.SliceLayout(1, a_copy))[:, None] * (2 * ROW_BYTES)
        + gl.arange(0, AC, layout=gl.SliceLayout(0, a_copy))[None, :]
    )
    n_per_expert = N // BNW
    it = 0
    for t in range(gl.program_id(0), n_tiles, P):
        base = t.to(gl.int64) * (BNW * ROW_BYTES)
        for j in range(ROW_BYTES // CB):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            if MODE == 2:
                mbarrier.expect(ready.index(slot), BNW * CB)
                tma.async_copy_global_to_shared(w_src, [t * BNW, j * CB], ready.index(slot), w_smem.index(slot))
            elif MODE == 1:
                async_copy.async_copy_global_to_shared(w_smem.index(slot), (w_src + base + j * (BNW * CB)) + w_off)
            else:
                async_copy.async_copy_global_to_shared(w_smem.index(slot), (w_src + base + j * CB) + w_off)
            if SCALES:
                async_copy.async_copy_global_to_shared(s_smem.index(slot), (s_ptr + base // 8 + j * (CB // 8)) + s_off)
            if BT > 0:
                a_base = (t // n_per_expert).to(gl.int64) * (BT * 2 * ROW_BYTES) + j * AC
                async_copy.async_copy_global_to_shared(a_smem.index(slot), (a_ptr + a_base) + a_off)
            if MODE != 2 or SCALES or BT > 0:
                async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
            it += 1


@gluon.jit
def _consumer(ready, empty, P, n_tiles, NK: gl.constexpr):
    """The consumer warps: wait for each slot, free it."""
    STAGES: gl.constexpr = ready.shape[0]
    it = 0
    for _t in range(gl.program_id(0), n_tiles, P):
        for _ in range(NK):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            mbarrier.arrive(empty.index(slot), count=1)
            it += 1


@gluon.jit
def _stream_kernel(
    w_ptr,
    s_ptr,
    a_ptr,
    P,
    n_tiles,
    total_rows,
    ROW_BYTES: gl.constexpr,
    MODE: gl.constexpr,
    SCALES: gl.constexpr,
    BNW: gl.constexpr,
    CB: gl.constexpr,
    BT: gl.constexpr,
    STAGES: gl.constexpr,
    LW: gl.constexpr,
):
    if MODE == 2:
        w_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    else:
        w_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BNW, CB], w_layout)
    s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BNW, CB // 8], plain)
    a_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BT if BT > 0 else 1, 2 * CB], plain)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if MODE == 2:  # a device-side TMA descriptor of the codes (needs triton.set_allocator)
        w_src = tma.make_tensor_descriptor(w_ptr, [total_rows, ROW_BYTES], [ROW_BYTES, 1], [BNW, CB], w_layout)
    else:
        w_src = w_ptr
    CP: gl.constexpr = MODE != 2 or SCALES or BT > 0
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=(LW * 32 if CP else 0) + (1 if MODE == 2 else 0))
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (_consumer, (ready, empty, P, n_tiles, ROW_BYTES // CB)),
            (_loader, (w_src, s_ptr, a_ptr, w_smem, s_smem, a_smem, ready, empty, P, n_tiles,
                       ROW_BYTES, MODE, SCALES, BNW, CB, BT, LW)),
        ],
        [LW],
        [88],
    )  # fmt: skip


def stream(
    codes, scales, acts, mode: str, bnw: int, cb: int, sc: bool, bt: int, stages: int, lw: int, ctas_per_sm: int,
    nw: int = 4, maxnreg: int | None = None,
):  # fmt: skip
    """Launch the probe kernel over all of codes [E*N, K/2] u8 (+ scales [E*N, K/16], + acts [E*BT, K]);
    nw consumer warps, maxnreg the launch's register cap. Returns the compiled kernel."""
    rows, row_bytes = codes.shape
    n_tiles = rows // bnw
    sms = torch.cuda.get_device_properties(codes.device).multi_processor_count
    p = n_tiles if ctas_per_sm == 0 else min(n_tiles, sms * ctas_per_sm)
    return _stream_kernel[(p,)](
        codes, scales, acts, p, n_tiles, rows, row_bytes, MODES[mode], sc, bnw, cb, bt,
        stages, lw, num_warps=nw, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip


SETS = {
    # (mode, BNW, CB, scales, BT, stages, LW, ctas_per_sm[, consumer warps, launch register cap])
    "patterns": [  # code bytes only: rows vs a pre-tiled copy vs TMA, 64-256 bytes per row per k-step
        ("flat", 128, 64, False, 0, 4, 4, 0),
        ("rows", 128, 64, False, 0, 4, 4, 0),
        ("tma", 128, 64, False, 0, 4, 1, 0),
        ("rows", 128, 128, False, 0, 4, 4, 0),
        ("rows", 128, 256, False, 0, 3, 4, 0),
        ("tma", 128, 128, False, 0, 4, 1, 0),
        ("flat", 128, 256, False, 0, 3, 4, 0),
        ("rows", 128, 64, False, 0, 8, 4, 0),
        ("rows", 128, 64, False, 0, 8, 4, 2),
        ("tma", 128, 64, False, 0, 8, 1, 2),
    ],
    "decode": [  # what the GEMM moves at 256 tokens (codes + scales + activation rows)
        ("rows", 128, 64, True, 32, 4, 4, 0),
        ("rows", 128, 64, True, 32, 4, 4, 0, 8, 80),  # the GEMM's ws tile: 8 consumer warps, 2 CTAs per SM
        ("rows", 128, 64, True, 32, 6, 4, 0, 8, 80),
        ("rows", 128, 128, True, 32, 3, 4, 0, 8, 80),
        ("rows", 128, 64, True, 16, 3, 4, 0),
        ("rows", 128, 64, True, 16, 3, 4, 0, 8, 80),
        ("rows", 128, 64, True, 16, 6, 4, 0, 8, 80),
        ("rows", 128, 128, True, 16, 3, 4, 0, 8, 80),
        ("rows", 128, 128, True, 16, 4, 4, 0, 8, 80),
        ("rows", 128, 128, True, 16, 3, 4, 2, 8, 80),
        ("tma", 128, 128, True, 16, 3, 4, 0, 8, 80),
        ("rows", 256, 64, True, 16, 3, 4, 0, 16, 64),
    ],
    "prefill": [
        ("rows", 128, 64, True, 64, 3, 4, 0, 8, 80),
        ("rows", 128, 128, True, 64, 2, 4, 0, 8, 80),
        ("rows", 128, 128, True, 64, 3, 4, 0, 8, 80),
        ("rows", 256, 64, True, 64, 3, 4, 0, 16, 64),
    ],
}


def occupancy(kernel, warps: int) -> str:
    """Registers per thread, shared memory per CTA and the CTAs per SM they allow (H200: 64K registers,
    227 KB shared memory per SM)."""
    regs, smem = kernel.n_regs, kernel.metadata.shared
    by_regs = 65536 // (warps * 32 * regs) if regs else 99
    by_smem = (233472 - 1024) // (smem + 1024)
    return f"{regs} regs, {smem // 1024} KB smem, {min(by_regs, by_smem, 64 // warps)} CTAs/SM"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default="patterns,decode,prefill")
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    codes = torch.randint(0, 256, (E * N, HIDDEN // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0, 120, (E * N, HIDDEN // 16), dtype=torch.uint8, device="cuda")
    acts = {bt: torch.randn(E * bt, HIDDEN, device="cuda").half() for bt in (16, 32, 64)}
    acts[0] = acts[16]
    x = torch.empty(codes.numel() // 4, dtype=torch.int32, device="cuda")
    us = bench(lambda: x.copy_(codes.view(torch.int32).view(-1)))
    print(f"reference: device copy of the codes (read + write {2 * codes.numel() / 1e6:.0f} MB): {us:.1f} us, "
          f"{2 * codes.numel() / us / 1e3:.0f} GB/s", flush=True)  # fmt: skip
    for name in args.sets.split(","):
        print(f"## {name}", flush=True)
        for mode, bnw, cb, sc, bt, st, lw, cps, *launch in SETS[name]:
            nw, cap = launch or (4, None)
            moved = codes.numel() + (scales.numel() if sc else 0) + (codes.shape[0] // bnw) * bt * HIDDEN * 2
            label = f"{mode:4s} BNW{bnw} CB{cb} scales {int(sc)} BT{bt} s{st} lw{lw} p{cps} w{nw} r{cap or '-'}"
            try:
                run = lambda: stream(codes, scales, acts[bt], mode, bnw, cb, sc, bt, st, lw, cps, nw, cap)  # noqa: E731
                label += f" ({occupancy(run(), nw + lw)})"
                us = bench(run)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  {label}: failed {repr(e)[:200]}", flush=True)
                continue
            print(f"  {label}: {us:.1f} us, {moved / us / 1e3:.0f} GB/s of {moved / 1e6:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
