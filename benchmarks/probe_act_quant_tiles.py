"""Device probe: activation-quant kernel (decoded operand, plain and dynamic RAC 50%) over rows per
program and warps, against its HBM floor (bf16 in + fp16 operand out at 3.3 TB/s).

python benchmarks/probe_act_quant_tiles.py [--rows 2048,32768,131072] [--order pairs|wgmma]
(CUDA GPU; CUDA-graph replay timings)
"""

import argparse
import itertools

import torch
import triton.testing
from quads_megatron.kernels import w4a4_grouped as kg


def t(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2048,32768,131072")
    ap.add_argument("--order", default="pairs", choices=["pairs", "wgmma"])
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        x = (
            torch.randn(rows, 2048, generator=g, device="cuda")
            * torch.exp(torch.randn(2048, generator=g, device="cuda"))
        ).bfloat16()
        floor = rows * 2048 * (2 + 2) / 3.3e12 * 1e6
        res = []
        for bm, nw in itertools.product((1, 2, 4, 8), (2, 4, 8)):
            for dyn in (0, 1024):
                try:
                    us = t(
                        lambda: kg.activation_operand(
                            x, check=False, block_m=bm, num_warps=nw, dynamic_channels=dyn, order=args.order
                        )
                    )
                except Exception:
                    us = float("nan")
                res.append((dyn, us, bm, nw))
        for dyn in (0, 1024):
            best = sorted([r for r in res if r[0] == dyn], key=lambda r: r[1])[:3]
            default = [r for r in res if r[0] == dyn and r[2] == 1 and r[3] == (4 if dyn else 2)][0]  # the launcher's
            top = [(f"bm{b} w{w}", round(u, 1)) for _, u, b, w in best]
            print(
                f"rows {rows} dyn {dyn}: floor {floor:.1f} us; default bm{default[2]} w{default[3]} "
                f"{default[1]:.1f} us; best {top}",
                flush=True,
            )


if __name__ == "__main__":
    main()
