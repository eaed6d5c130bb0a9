"""Device probe: tiles of the Gluon Hopper W4A4 GEMM (kernels/gemm_wgmma.py) on the Qwen3-30B-A3B fc1 (or
fc2) shape, per token count, side by side with the Triton GEMM at its tuned tiles and the bf16 / FP8 peers;
each tile is checked against the Triton GEMM (same exact products, other fp32 order).

python dev/probe_wgmma_tiles.py [--tokens 16,64,256,1024,4096,16384] [--budget-s 300] [--match REGEX]
    [--mask-rows] [--narrow] [--gemm fc1|fc2] [--layout rows|tiled] [--l2-prefetch 0,4] [--write-config]
(CUDA GPU; CUDA-graph replay medians; fc1: token-indexed rows as moe_w4a4 runs it, fc2: one operand row per
grouped row, N = hidden, K = intermediate; no RAC; --layout tiled: every quads GEMM on weight_layout's
tiled weights, the layout the SGLang method serves)
--write-config: the winning tile of each rule the probed row counts fall in (the GEMM's N and K, bf16
output) into configs/wgmma_gemm.json under this GPU's name (dev/tile_writer.py); fc2's K falls in the
max_k rules.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

import torch
import triton.runtime.errors
import triton.testing

from quads_megatron import nvfp4
from quads_megatron.errors import KernelConfigError
from quads_megatron.kernels import act_quant, gemm_triton, tile_configs, weight_layout
from quads_megatron.kernels import gemm_wgmma_launch as wg
from quads_megatron.kernels.tile_configs import WgmmaConfig
from quads_megatron.rollout.moe_block import route

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from tile_writer import current_first, write_config  # noqa: E402

E, HIDDEN, INTER, TOPK = 128, 2048, 768, 8


def tiles(rows: int) -> list[tuple]:
    """(block_t, warps, stages, chunks, unroll, maxnreg, loader_warps, ctas_per_sm[, split]) worth trying at this
    many grouped rows. loader_warps > 0: the warp-specialized kernel (cp.async loader warps + mbarrier
    ring; its maxnreg is the launch's, split between partitions, and sets CTAs per SM); chunks 2 there:
    two 128-K chunks (128 code bytes of each weight row) per ring slot, and with unroll 2 the first one's
    wgmma in flight under the second one's decode (needs ~128+ consumer registers, else ptxas serializes
    the wgmmas: one CTA per SM); ctas_per_sm > 0: its CTAs persist
    (SMs * ctas_per_sm of them loop over the tiles). Left out: 4-warp consumers, 16 warps, deeper rings
    and an L2 bulk prefetch of each CTA's code rows, slower everywhere in the sweeps of 2026-12-02
    (dev/results/probe_wgmma_tiles.txt)."""
    if rows <= 1024:
        return [
            (16, 8, 3, 1, 1, None, 0, 0),
            (16, 8, 3, 1, 1, 80, 4, 0),
            (16, 8, 3, 2, 1, 80, 4, 0),
            (16, 8, 4, 2, 1, 80, 4, 0),
            (16, 8, 3, 2, 1, 80, 4, 2),
        ]
    if rows <= 4096:
        return [
            (16, 8, 3, 1, 1, None, 0, 0),
            (32, 8, 4, 1, 1, 80, 4, 0),
            (16, 8, 3, 2, 1, 80, 4, 0),
            (16, 8, 4, 2, 1, 80, 4, 0),
            (32, 8, 3, 2, 1, 80, 4, 0),
            (16, 8, 3, 2, 1, 80, 4, 2),
            (32, 8, 3, 2, 1, 80, 4, 2),
            (32, 8, 3, 2, 2, 96, 4, 0),
            (32, 8, 4, 1, 1, 80, 4, 0, 1),
            (32, 8, 3, 2, 1, 80, 4, 0, 1),
            (16, 8, 3, 2, 1, 80, 4, 0, 1),
            (32, 8, 4, 2, 1, 80, 4, 0, 1),
            (32, 8, 2, 2, 1, 80, 4, 0, 1),
            (32, 8, 3, 2, 1, 80, 4, 2, 1),
            (64, 8, 3, 1, 1, 80, 4, 0, 1),
            (64, 8, 2, 2, 1, 80, 4, 0, 1),
        ]
    if rows <= 16384:
        return [
            (64, 8, 3, 1, 1, 80, 4, 0),
            (32, 8, 3, 2, 1, 80, 4, 0),
            (64, 8, 2, 2, 1, 80, 4, 0),
            (32, 8, 3, 2, 1, 80, 4, 2),
            (64, 8, 2, 2, 1, 80, 4, 2),
            (64, 8, 3, 1, 1, 80, 4, 0, 1),
            (64, 8, 2, 2, 1, 80, 4, 2, 1),
            *WIDE_TILES,
        ]
    return [
        (64, 8, 3, 1, 1, 80, 4, 2),
        (128, 8, 3, 1, 1, 168, 4, 1),
        (64, 8, 2, 2, 1, 80, 4, 2),
        (32, 8, 3, 2, 1, 80, 4, 2),
        (128, 8, 2, 2, 1, 168, 4, 1),
        (128, 8, 2, 2, 2, 168, 4, 1),
        (64, 8, 3, 2, 2, 128, 4, 1),
        (64, 8, 3, 1, 1, 80, 4, 2, 1),
        (128, 8, 2, 2, 2, 168, 4, 1, 1),
        (128, 8, 3, 1, 1, 168, 4, 1, 1),
        (128, 8, 4, 1, 1, 168, 4, 1, 1),
        (64, 8, 3, 2, 2, 128, 4, 1, 1),
        (256, 8, 2, 1, 1, 168, 4, 1, 1),
        (256, 8, 2, 1, 1, 168, 4, 0, 1),
        *(t for t in WIDE_TILES if t != (128, 8, 2, 2, 2, 168, 4, 1, 1)),  # that one is above
    ]


#: one CTA per SM, with room for 128-token accumulators or a third consumer warpgroup (192 weight rows, N % 192 == 0:
#: fc1; on fc2's N = 2048 the sweep reports them failed). At ~64 grouped rows per expert (1024 tokens) a 64-token
#: tile gives about half the experts a second, nearly empty tile; a narrow 128-token tile covers them in one.
WIDE_TILES = [
    (128, 8, 2, 2, 1, 168, 4, 1, 1),
    (128, 8, 2, 2, 2, 168, 4, 1, 1),
    (128, 8, 3, 1, 1, 168, 4, 0, 1),
    (128, 12, 2, 2, 1, 128, 4, 1, 1),
    (128, 12, 3, 1, 1, 128, 4, 1, 1),
    (64, 12, 3, 2, 1, 128, 4, 1, 1),
    (64, 12, 3, 1, 1, 128, 4, 0, 1),
]


#: the fields of a tiles() tuple, in order
FIELDS = ("block_t", "num_warps", "stages", "chunks", "unroll", "maxnreg", "loader_warps", "ctas_per_sm", "split")


def full_fields(f: dict) -> dict:
    """Every WgmmaConfig field of a tile (defaults filled in, split a bool), so that equal tiles compare equal."""
    out = {x.name: x.default for x in dataclasses.fields(WgmmaConfig) if x.default is not dataclasses.MISSING}
    out.update(f)
    out["split"] = bool(out["split"])
    return out


def tile_name(f: dict) -> str:
    """How a tile (full_fields) is printed, and what --match searches."""
    name = f"BT{f['block_t']} w{f['num_warps']} s{f['stages']} c{f['chunks']} u{f['unroll']} "
    name += f"r{f['maxnreg'] or '-'} ws{f['loader_warps']} p{f['ctas_per_sm']}"
    flags = [("split", "split"), ("mask_rows", "masked rows"), ("narrow", "narrow"), ("tma_store", "tma store")]
    name += "".join(f" {text}" for key, text in flags if f[key])
    return name + (f" l2 {f['l2_prefetch']}" if f.get("l2_prefetch") else "")


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def expert_weights(
    g: torch.Generator, n: int = 2 * INTER, k: int = HIDDEN
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random bf16 expert weights [E, N, K] (default fc1's [E, 2I, H]) and their NVFP4 (codes, scales,
    S_dec) stacked per expert."""
    w = torch.randn(E, n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    return w, gemm_triton.stack_expert_weights([nvfp4.quantize(w[e]) for e in range(E)])


def fc1_rows(tokens: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random top-k routing of tokens: expert offsets, each grouped row's token (int32), grouped rows."""
    ids = torch.randn(tokens, E, generator=g, device="cuda").topk(TOPK, dim=-1).indices
    order, offs, _ = route(ids, E)
    return offs, (order // TOPK).to(torch.int32), int(offs[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,256,1024,4096,16384")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--match", default="", help="only the tiles whose name (as printed) this regex finds")
    ap.add_argument("--mask-rows", action="store_true", help="also each tile with rows past the expert zero-filled")
    ap.add_argument("--narrow", action="store_true", help="also each warp-specialized tile (BT >= 32) with narrow")
    ap.add_argument("--write-config", action="store_true", help="write the winners into configs/wgmma_gemm.json")
    ap.add_argument("--gemm", choices=("fc1", "fc2"), default="fc1", help="fc2: N=hidden, K=inter (its max_k rules)")
    ap.add_argument("--layout", choices=("rows", "tiled"), default="rows", help="the NVFP4 weights' layout")
    ap.add_argument(
        "--l2-prefetch", default="0", help="comma-separated l2_prefetch values each warp-specialized tile also runs at"
    )
    args = ap.parse_args()
    l2s = [int(v) for v in args.l2_prefetch.split(",")]
    n_out, k_in = (2 * INTER, HIDDEN) if args.gemm == "fc1" else (HIDDEN, INTER)
    runs = []  # (rule, rows, tile, us) for --write-config
    t0 = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    w, (wc, wsc, wsd) = expert_weights(g, n_out, k_in)
    if args.layout == "tiled":
        wc, wsc = weight_layout.tile_weights(wc, wsc)
    w_amax = w.float().abs().amax(-1)
    w8 = (w.float() / (w_amax / 448).unsqueeze(-1)).to(torch.float8_e4m3fn)
    for tokens in (int(t) for t in args.tokens.split(",")):
        offs, tok, rows = fc1_rows(tokens, g)
        if args.gemm == "fc2":  # fc2's operand: one row per grouped row (SiLU(gate) * up), not token-indexed
            tok = None
        xt = (
            torch.randn(tokens if tok is not None else rows, k_in, generator=g, device="cuda")
            * torch.exp(torch.randn(k_in, generator=g, device="cuda"))
        ).bfloat16()
        x = xt if tok is None else xt[tok]
        bf16 = bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
        xa = x.float().abs().amax(-1)
        x8, sx8 = (x.float() / (xa / 448).unsqueeze(-1)).to(torch.float8_e4m3fn), (xa / 448).float()
        fp8 = bench(
            lambda: torch._scaled_grouped_mm(
                x8, w8.transpose(-2, -1), sx8, (w_amax / 448).float(), offs=offs, out_dtype=torch.bfloat16
            )
        )
        pairs, perm = act_quant.activation_operand(xt), act_quant.activation_operand(xt, order="wgmma")
        want = gemm_triton.grouped_w4a4(pairs, offs, wc, wsc, wsd, out_dtype=torch.float32, a_rows=tok)
        want16 = gemm_triton.grouped_w4a4(pairs, offs, wc, wsc, wsd, a_rows=tok)
        triton_us = bench(lambda: gemm_triton.grouped_w4a4(pairs, offs, wc, wsc, wsd, a_rows=tok))
        rule, current = tile_configs.match_rule("wgmma_gemm", "cuda", rows=rows, n=n_out, out_bytes=2, k=k_in)
        print(
            f"tokens {tokens} rows {rows}: bf16 {bf16:.1f} us, fp8 {fp8:.1f} us, triton gemm {triton_us:.1f} us "
            f"({bf16 / triton_us:.2f}x bf16)",
            flush=True,
        )
        res = []
        # --write-config: rows past an expert zero-filled (faster since c602de7), narrow tiles tried, and the
        # rule's current tile timed first, so that the writer keeps it unless a candidate beats it
        masks = (True,) if args.write_config else ((False, True) if args.mask_rows else (False,))
        narrows = args.narrow or args.write_config
        variants = [
            full_fields(
                {**dict(zip(FIELDS, (*t, False)[:9], strict=True)), "mask_rows": m, "narrow": nr, "l2_prefetch": l2}
            )
            for t in tiles(rows)
            for m in masks
            for nr in ((False, True) if narrows and t[6] and t[0] >= 32 else (False,))
            for l2 in (l2s if t[6] else (0,))
        ]
        if args.write_config:
            variants = current_first(full_fields(current["tile"]), variants)
        for fields in variants:
            name = tile_name(fields)
            if not re.search(args.match, name):
                continue
            if time.time() - t0 > args.budget_s:
                print("budget spent; sweep cut short", flush=True)
                break
            try:
                kw = WgmmaConfig(**fields)
                try:
                    got = wg.grouped_w4a4_wgmma(
                        perm.values, perm.global_decode, offs, wc, wsc, wsd, torch.float32, tok, config=kw
                    )
                    err = ((got - want)[:rows].norm() / want[:rows].norm()).item()
                except (triton.runtime.errors.OutOfResources, KernelConfigError):
                    # fp32 output's epilogue scratch, or a TMA-store tile (2-byte output only): check in bf16
                    got = wg.grouped_w4a4_wgmma(
                        perm.values, perm.global_decode, offs, wc, wsc, wsd, a_rows=tok, config=kw
                    )
                    err = ((got.float() - want16.float())[:rows].norm() / want16.float()[:rows].norm()).item()
                us = bench(
                    lambda kw=kw: wg.grouped_w4a4_wgmma(
                        perm.values, perm.global_decode, offs, wc, wsc, wsd, a_rows=tok, config=kw
                    )
                )
            except Exception as e:  # out of shared memory / registers: report and go on
                print(f"  tile {name} failed: {repr(e)[:160]}", flush=True)
                continue
            res.append((us, name, err))
            runs.append((rule, rows, dataclasses.asdict(kw), us))
            print(
                f"  {name}: {us:.1f} us  {bf16 / us:.2f}x bf16  "
                f"{fp8 / us:.2f}x fp8  {triton_us / us:.2f}x triton  rel err vs triton {err:.1e}",
                flush=True,
            )
        if res:
            best = min(res)
            d = tile_configs.wgmma_config(rows, n_out, device="cuda", k=k_in)
            print(f"  best {best[1]} {best[0]:.1f} us; default {d}; max err {max(r[2] for r in res):.1e}", flush=True)
    if args.write_config:
        print("written:", write_config("wgmma_gemm", runs), flush=True)


if __name__ == "__main__":
    main()
