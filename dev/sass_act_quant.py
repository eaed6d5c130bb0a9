"""Offline sm_90 SASS of the activation quantization (kernels/act_quant.py) as fc2 runs it by default: the gated
input (SiLU(gate) * up, K = 768), the decoded operand in the "wgmma" order, one row per program. Compiles on a
machine without a GPU (Triton AOT, cuobjdump) and prints registers and instructions per row, with the row
as one tile padded to 1024 and, without RAC, as two pieces (512 + 256, act_quant.row_split).

python dev/sass_act_quant.py [--warps 1] [--k 768] [--rac none|static|dynamic] [--plain]
(--rac: the residual of a static plan or of the dynamic per-token selection folded into the operand, as the
block's RAC runs it, where the row is one tile; --plain: fc1's ungated input)
"""

from __future__ import annotations

import argparse
import collections
import inspect
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quads_megatron.kernels import act_quant
from quads_megatron.kernels.sass_check import disassemble, registers_per_thread

POINTERS = {
    "x_ptr": "*bf16", "op_ptr": "*fp16", "sdec_ptr": "*fp32", "amax_ptr": "*fp32", "valid_ptr": "*i8", "mask_ptr": "*i8"
}  # fmt: skip


def compile_operand(k: int, warps: int, split_k: int, rac: str = "none", gated: bool = True) -> dict:
    """Registers, instructions and the commonest opcodes of the operand kernel (one row per program)."""
    fn = act_quant._act_quant_kernel
    params = list(inspect.signature(fn.fn).parameters)
    consts = dict(
        K=k, STATIC=False, HAS_RES=rac != "none", DYNAMIC=rac == "dynamic", OPERAND=True, WGMMA_ORDER=True, GATED=gated,
        HAS_VALID=True, X_BF16=True, FOUR_OVER_SIX=False, FOS_MSE=False, E4M3_MAX=448.0, BLOCK_M=1,
        BLOCK_K=triton.next_power_of_2(k), SPLIT_K=split_k, HAS_TM=False, TM_BM=1, TM_BLOCK_E=2, TM_BLOCK_P=64,
        HAS_ROUTE=False, R_TOPK=1, R_BLOCK=16, R_NB=2, R_HISTOGRAM=True, PDL=True,
    )  # fmt: skip
    sig = {p: "constexpr" if p in consts else POINTERS.get(p, "*i32") if p.endswith("_ptr") else "i32" for p in params}
    # pointers and the row stride divisible by 16, as Triton's JIT specializes them at fc2's shapes (2I = 1536)
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params if p.endswith("_ptr") or p == "stride_xm"}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, enable_fp_fusion=False)
    )
    body = [ln for ln in disassemble(compiled.asm["cubin"]).splitlines() if re.search(r"\b[A-Z][A-Z0-9]+[.;\s]", ln)]
    ops = collections.Counter()
    for ln in body:
        words = [w for w in ln.split() if re.match(r"^[A-Z][A-Z0-9]*(\.|;|$)", w)]
        if words:
            ops[words[0].split(".")[0].rstrip(";")] += 1
    return {"regs": registers_per_thread(compiled.asm["cubin"]), "instructions": sum(ops.values()), "ops": ops}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--k", type=int, default=768)
    ap.add_argument("--rac", choices=("none", "static", "dynamic"), default="none")
    ap.add_argument("--plain", action="store_true", help="fc1's input: no SiLU(gate) * up")
    args = ap.parse_args()
    # the two pieces where the launch holds the row so (act_quant.row_split: by default only without a residual)
    p = act_quant.row_split(args.k, triton.next_power_of_2(args.k), args.rac == "dynamic", "wgmma", args.rac != "none")
    pieces = [("one padded tile", 0)] + ([("two pieces", p)] if p else [])
    for name, split_k in pieces:
        r = compile_operand(args.k, args.warps, split_k, args.rac, not args.plain)
        print(
            f"K={args.k} {args.warps} warp(s), rac {args.rac}, {'plain' if args.plain else 'gated'}, {name}: "
            f"{r['regs']} registers, {r['instructions']} instructions "
            f"(the whole kernel: one row); commonest {r['ops'].most_common(8)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
