"""Offline (no GPU): compile the grouped W4A4 GEMM for sm_90 and count the SASS of its K loop.

    python dev/sass_gemm_loop.py 16,128,256,4,3 64,128,128,4,2 [--a-rows] [--dump DIR]

Per tile (BM, BN, BK, warps, stages): instructions in the main loop per thread and per weight
element decoded, register moves, MMA instructions, registers per thread, shared memory, and the
MMA version Triton chose (2 = mma.sync, 3 = wgmma). Uses Triton's ahead-of-time compiler and the
cuobjdump it bundles; this is how the decode costs in docs/kernel-notes.md were read.
"""

from __future__ import annotations

import argparse
import os
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quads_megatron.kernels import gemm_triton
from quads_megatron.kernels.sass_check import disassemble, registers_per_thread

SIGNATURE = {
    **dict.fromkeys(["a_ptr"], "*fp16"),
    **dict.fromkeys(["as_ptr", "r_ptr", "rs_ptr", "w_ptr", "ws_ptr"], "*u8"),
    **dict.fromkeys(["asdec_ptr", "wsdec_ptr"], "*fp32"),
    "rmask_ptr": "*i8",
    "tmap_ptr": "*i32",
    "arows_ptr": "*i64",
    "y_ptr": "*bf16",
    **dict.fromkeys(["N", "rmask_estride", "wsdec_stride"], "i32"),
}
CONSTEXPRS = ["K", "HAS_RES", "HAS_AROWS", "USE_ASM", "A_OPERAND", "OUT_BF16", "BM", "BN", "BK", "PDL"]


def loop_stats(bm: int, bn: int, bk: int, warps: int, stages: int, k: int = 2048, a_rows: bool = False, dump=None):
    consts = dict(K=k, HAS_RES=False, HAS_AROWS=a_rows, USE_ASM=True, A_OPERAND=True, OUT_BF16=True)
    consts.update(BM=bm, BN=bn, BK=bk, PDL=False)
    sig = {**SIGNATURE, **dict.fromkeys(CONSTEXPRS, "constexpr")}
    src = ASTSource(
        fn=gemm_triton._grouped_w4a4_kernel,
        signature=sig,
        constexprs=consts,
        attrs={(i,): [["tt.divisibility", 16]] for i in range(12)},
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    sass = disassemble(compiled.asm["cubin"])  # whole (Triton's own dump ends at 64 KB)
    body = re.search(r"^(L[0-9a-f]+):\n(.*?)BRA \1;", sass, re.S | re.M)  # the first loop: a label branched back to
    lines = [ln for ln in (body.group(2) if body else "").splitlines() if ln.strip()]
    if dump:
        os.makedirs(dump, exist_ok=True)
        for key, text in (("ttgir", compiled.asm["ttgir"]), ("sass", sass)):  # the SASS read, not Triton's dump
            with open(os.path.join(dump, f"gemm_{bm}_{bn}_{bk}_{warps}_{stages}.{key}"), "w") as out:
                out.write(text)
    return {
        "loop": len(lines),
        "per_weight": len(lines) / (bn * bk / (32 * warps)),
        "moves": sum("MOV" in ln for ln in lines),
        "mma": sum("MMA" in ln for ln in lines),
        "regs": registers_per_thread(compiled.asm["cubin"]),
        "smem": compiled.metadata.shared,
        "mma_version": sorted(set(re.findall(r"versionMajor = (\d)", compiled.asm["ttgir"]))),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tiles", nargs="+", help="BM,BN,BK,warps,stages")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--a-rows", action="store_true", help="token-indexed activation rows (as moe_w4a4's fc1)")
    ap.add_argument("--dump", default=None, help="also write the TTGIR and SASS here")
    args = ap.parse_args()
    for t in args.tiles:
        bm, bn, bk, w, s = (int(v) for v in t.split(","))
        r = loop_stats(bm, bn, bk, w, s, args.k, args.a_rows, args.dump)
        print(
            f"BM{bm} BN{bn} BK{bk} w{w} s{s}: loop {r['loop']} instructions/thread, {r['per_weight']:.2f} per weight, "
            f"{r['moves']} moves, {r['mma']} MMA, {r['regs']} regs, {r['smem']} B smem, mma v{r['mma_version']}"
        )


if __name__ == "__main__":
    main()
