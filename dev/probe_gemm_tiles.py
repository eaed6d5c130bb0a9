"""Device probe: grouped W4A4 GEMM tiles (BM, BN, BK, warps, stages) on the Qwen3-30B-A3B fc1 (or fc2) shape,
per token count; prints the best tiles, the shipped default (configs/triton_gemm.json), and a GPU check
that the PTX decode and the integer-op decode give the same output bits on every probed tile.

python dev/probe_gemm_tiles.py [--tokens 16,64,256,1024,4096,16384] [--budget-s 420] [--write-config]
(CUDA GPU; CUDA-graph replay timings, decoded-operand path, no RAC; fc1 reads its operand by token as
moe_w4a4 runs it; each rule's current tile is among the candidates, so --write-config keeps it unless beaten)
--write-config: the winning tile of each row bucket into configs/triton_gemm.json under this GPU's name
(dev/tile_writer.py); with --gemm fc2 into the rules for K <= max_k (fc2's K is the intermediate size).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import triton.testing

from quads_megatron.kernels import act_quant, gemm_triton, tile_configs
from quads_megatron.kernels.tile_configs import TritonGemmConfig

# the benchmark's GPU check of the GEMM's decode, the writer of the data files, the probes' shapes
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from bench_moe_w4a4 import check_tile_decode  # noqa: E402
from probe_wgmma_tiles import HIDDEN, INTER, expert_weights, fc1_rows  # noqa: E402
from tile_writer import current_first, write_config  # noqa: E402


def tiles(rows: int) -> list[tuple[int, int, int, int, int]]:
    if rows <= 8192:  # weight-streaming regime: 16-row tiles
        out = []
        for bn, bk, w, s in itertools.product((32, 64, 128, 256), (64, 128, 256), (2, 4, 8), (2, 3, 4)):
            if (w == 2 and bn > 64) or (w == 8 and bn < 128) or bn * bk > 32768:
                continue
            out.append((16, bn, bk, w, s))
        return out
    out = []
    for bm, bn, bk, w, s in itertools.product((64, 128, 256), (128, 256), (32, 64, 128), (4, 8), (2, 3, 4)):
        if (bm == 256 and w == 4) or (bm == 64 and w == 8) or bm * bn > 256 * 128 or bn * bk > 256 * 64:
            continue
        out.append((bm, bn, bk, w, s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,256,1024,4096,16384")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--write-config", action="store_true", help="write the winners into configs/triton_gemm.json")
    ap.add_argument("--gemm", choices=("fc1", "fc2"), default="fc1", help="fc2: N=hidden, K=inter (its max_k rules)")
    args = ap.parse_args()
    n_out, k_in = (2 * INTER, HIDDEN) if args.gemm == "fc1" else (HIDDEN, INTER)
    t0 = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    print("ptx decode exact (all codes x scales):", check_tile_decode("cuda", use_asm=True), flush=True)
    _, (wc, wsc, wsd) = expert_weights(g, n_out, k_in)
    same_bits = True
    runs = []  # (rule, rows, tile, us) for --write-config
    for tokens in (int(t) for t in args.tokens.split(",")):
        offs, tok, rows = fc1_rows(tokens, g)
        if args.gemm == "fc2":  # fc1 reads each grouped row's token, fc2 one operand row per grouped row
            tok = None
        x = (
            torch.randn(tokens if tok is not None else rows, k_in, generator=g, device="cuda")
            * torch.exp(torch.randn(k_in, generator=g, device="cuda"))
        ).bfloat16()
        op = act_quant.activation_operand(x)
        rule, current = tile_configs.match_rule("triton_gemm", "cuda", rows=rows, k=k_in)
        cur = tuple(current["tile"][f] for f in ("block_m", "block_n", "block_k", "num_warps", "num_stages"))
        candidates = current_first(cur, tiles(rows))  # --write-config keeps the rule's tile unless beaten
        res = []
        for bm, bn, bk, nw, ns in candidates:
            if time.time() - t0 > args.budget_s:
                print("budget spent; sweep cut short", flush=True)
                break
            kw = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            cfg = TritonGemmConfig(**kw)
            try:
                y = gemm_triton.grouped_w4a4(op, offs, wc, wsc, wsd, a_rows=tok, config=cfg, use_asm=True)
                y0 = gemm_triton.grouped_w4a4(op, offs, wc, wsc, wsd, a_rows=tok, config=cfg, use_asm=False)
                same_bits &= torch.equal(y, y0)
                us = triton.testing.do_bench_cudagraph(
                    lambda cfg=cfg: gemm_triton.grouped_w4a4(
                        op, offs, wc, wsc, wsd, a_rows=tok, config=cfg, use_asm=True
                    ),
                    rep=30,
                    return_mode="median",
                )
                res.append((us * 1e3, bm, bn, bk, nw, ns))
                runs.append((rule, rows, kw, us * 1e3))
            except Exception as e:  # out of shared memory / registers: report and go on
                print(f"tokens {tokens} tile {kw} failed: {repr(e)[:120]}", flush=True)
        d = tile_configs.triton_gemm_config(rows, k_in, "cuda")
        dk = (d.block_m, d.block_n, d.block_k, d.num_warps, d.num_stages)
        default = [r for r in res if r[1:] == dk]
        best = sorted(res)[:6]
        print(
            f"tokens {tokens} rows {rows}: default {dk} "
            f"{default[0][0] if default else float('nan'):.1f} us; best "
            + "; ".join(f"{u:.1f} us BM{a} BN{b} BK{c} w{n} s{s}" for u, a, b, c, n, s in best),
            flush=True,
        )
    print("ptx and int-op decode give the same output bits on every tile:", same_bits, flush=True)
    if args.write_config:
        print("written:", write_config("triton_gemm", runs), flush=True)


if __name__ == "__main__":
    main()
