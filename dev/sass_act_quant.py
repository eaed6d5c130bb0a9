"""Offline sm_90 SASS of the activation quantization (kernels/act_quant.py) as fc2 runs it by default: the gated
input (SiLU(gate) * up, K = 768), the decoded operand in the "wgmma" order, one row per program. Compiles on a
machine without a GPU (Triton AOT, cuobjdump: sass_check.compile_act_quant_sm90) and prints registers and
instructions per row, with the row as one tile padded to 1024 and as two pieces (512 + 256, act_quant.row_split;
with dynamic RAC both pieces' blocks ranked together).

python dev/sass_act_quant.py [--warps 1] [--k 768] [--rac none|static|dynamic] [--plain]
(--rac: the residual of a static plan or of the dynamic per-token selection folded into the operand, as the
block's RAC runs it; --plain: fc1's ungated input)
"""

from __future__ import annotations

import argparse

import triton

from quads_megatron.kernels import act_quant
from quads_megatron.kernels.sass_check import compile_act_quant_sm90


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--k", type=int, default=768)
    ap.add_argument("--rac", choices=("none", "static", "dynamic"), default="none")
    ap.add_argument("--plain", action="store_true", help="fc1's input: no SiLU(gate) * up")
    args = ap.parse_args()
    # the two pieces wherever K allows them (act_quant.row_split; a tile's split_row chooses)
    p = act_quant.row_split(args.k, triton.next_power_of_2(args.k), "wgmma", args.rac != "none", want=True)
    pieces = [("one padded tile", 0)] + ([("two pieces", p)] if p else [])
    for name, split_k in pieces:
        r = compile_act_quant_sm90(args.k, args.warps, split_k, args.rac, not args.plain)
        print(
            f"K={args.k} {args.warps} warp(s), rac {args.rac}, {'plain' if args.plain else 'gated'}, {name}: "
            f"{r['regs']} registers, {r['instructions']} instructions, {r['reciprocals']} MUFU.RCP "
            f"(the whole kernel: one row); commonest {sorted(r['ops'].items(), key=lambda kv: -kv[1])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
