"""Device probe: activation-quant kernel (decoded operand; plain, static RAC 50% and dynamic RAC 50%)
over rows per program and warps, against its HBM floor (input in + fp16 operand out at 3.3 TB/s).

python dev/probe_act_quant_tiles.py [--rows 128,2048,16384,131072] [--order auto|pairs|wgmma]
    [--inputs fc1|fc2|both] [--block-m 1,2,4] [--warps 1,2,4,8] [--write-config]
--inputs: fc1's quantization ([rows, 2048]), fc2's (input [rows, 2I] = [gate | up], I = 768, SiLU(gate) *
up quantized), or both in one sweep. --order auto: the order moe_w4a4 uses at that size ("wgmma" above
1024 rows, where the Gluon GEMM runs; "pairs" below). (CUDA GPU; CUDA-graph replay timings)
Where K allows it (act_quant.row_split: fc2's K = 768 = 512 + 256) every tile is timed with the row as one padded
tile and as two pieces (split_row false / true, same bits); where it does not (fc1), split_row changes nothing and
the one timing stands for both.
--write-config: the winning (block_m, num_warps, split_row) of each rule the probed points fall in into
configs/act_quant.json under this GPU's name (dev/tile_writer.py). Rules that do not state `gated` hold
for both inputs: sweep --inputs both, so that one writer sees all of their points.
"""

import argparse
import itertools
import os
import sys

import torch
import triton.testing

from quads_megatron.kernels import act_quant, tile_configs
from quads_megatron.kernels.tile_configs import ActQuantConfig
from quads_megatron.rollout import moe_block, rac_plan, reference

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from tile_writer import write_config  # noqa: E402


def t(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128,2048,16384,131072")
    ap.add_argument("--order", default="auto", choices=["auto", "pairs", "wgmma"])
    ap.add_argument("--inputs", default="both", choices=["fc1", "fc2", "both"])
    ap.add_argument("--block-m", default="1,2,4", help="rows per program to sweep")
    ap.add_argument("--warps", default="1,2,4,8", help="warps per program to sweep")
    ap.add_argument("--write-config", action="store_true", help="write the winners into configs/act_quant.json")
    args = ap.parse_args()
    block_ms = [int(v) for v in args.block_m.split(",")]
    warps = [int(v) for v in args.warps.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    runs = []  # (rule, (gated, rows, mode), tile, us) for --write-config
    for gated in {"fc1": (False,), "fc2": (True,), "both": (False, True)}[args.inputs]:
        k = 768 if gated else 2048
        width = 2 * k if gated else k
        for rows in (int(r) for r in args.rows.split(",")):
            order = args.order if args.order != "auto" else ("wgmma" if rows > 1024 else "pairs")
            x = (
                torch.randn(rows, width, generator=g, device="cuda")
                * torch.exp(torch.randn(width, generator=g, device="cuda"))
            ).bfloat16()
            h = moe_block.gated_activation(x) if gated else x
            plan = rac_plan.RACPlan.from_scores(reference.residual_block_scores(h[:256].float()).sum(0), k // 2)
            mask = plan.block_mask("cuda").to(torch.int8)
            modes = {"plain": {}, "static50": dict(plan=plan, block_mask=mask), "dyn50": dict(dynamic_channels=k // 2)}
            floor = rows * (width * 2 + k * 2) / 3.3e12 * 1e6

            def run(mode, config=None, x=x, order=order, gated=gated, modes=modes):
                return t(
                    lambda: act_quant.activation_operand(
                        x, check=False, order=order, gated=gated, config=config, **modes[mode]
                    )
                )

            # split_row matters only where K is a power of two + a smaller one (row_split, whole row held)
            splits = (False, True) if act_quant.row_split(k, 1 << (k - 1).bit_length(), order, want=True) else (None,)
            for mode in modes:
                facts = dict(rows=rows, rac=mode != "plain", dynamic=mode == "dyn50", gated=gated)
                rule = tile_configs.match_rule("act_quant", "cuda", **facts)[0]
                res = []
                for bm, nw, split in itertools.product(block_ms, warps, splits):
                    try:
                        us = run(mode, ActQuantConfig(block_m=bm, num_warps=nw, split_row=split))
                    except Exception:  # a tile that does not fit: left out
                        continue
                    res.append((us, bm, nw, split))
                    for s in (False, True) if split is None else (split,):  # no split here: one timing for both
                        runs.append((rule, (gated, rows, mode), {"block_m": bm, "num_warps": nw, "split_row": s}, us))
                best = sorted(res, key=lambda r: r[0])[:3]
                top = [(f"bm{b} w{w}" + (" split" if sp else ""), round(u, 1)) for u, b, w, sp in best]
                print(
                    f"{'fc2' if gated else 'fc1'} rows {rows} {mode} ({order}): floor {floor:.1f} us; "
                    f"tuned {run(mode):.1f} us; best {top}",
                    flush=True,
                )
    if args.write_config:
        print("written:", write_config("act_quant", runs), flush=True)


if __name__ == "__main__":
    main()
