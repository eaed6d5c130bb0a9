"""Device probe: tiles of the decode-size Gluon GEMM (kernels/gemm_mma.py) on Qwen3-30B-A3B's fc1 and fc2,
per token count, against the GEMM moe_w4a4(impl='auto') ran there without it (Triton, or the Gluon wgmma
kernel where that one is the faster), on the same inputs; every tile's output checked against the Triton GEMM.

python dev/probe_mma_tiles.py [--tokens 16,32,64,128,256] [--budget-s 300] [--write-config] [--tiles JSON]
(CUDA GPU; CUDA-graph replay medians; fc1 reads its operand by token as moe_w4a4 runs it, fc2 one row per
grouped row)
After each GEMM's sweep its 3 best tiles run again on tile_weights' layout (A/B, same bits; --no-tiled: not).
--layout tiled: the sweep and its baseline run on the tiled weights (tiles for serving that layout; no A/B).
--write-config: the winning tile of each rule into configs/mma_gemm.json under this GPU's name
(dev/tile_writer.py), and used_up_to_rows: the largest probed row count up to which the best tiles' fc1 + fc2
beat the other GEMMs' at every probed count (0 where they lose at the first).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import torch
import triton.testing

from quads_megatron.kernels import act_quant, gemm_mma_launch, gemm_triton, tile_configs, weight_layout
from quads_megatron.kernels.tile_configs import MmaConfig

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from probe_wgmma_tiles import HIDDEN, INTER, expert_weights, fc1_rows  # noqa: E402
from tile_writer import CONFIGS, current_first, dumps_table, write_config  # noqa: E402

FIELDS = ("block_t", "num_warps", "row_groups", "chunks", "prefetch", "weight_loads", "weights_first")
SHOWN = (*FIELDS, "l2_prefetch", "ctas_per_sm")  # how a tile is printed: FIELDS, L2 prefetch distance, persistence


def candidates(rows: int) -> list[dict]:
    """8-token tiles up to 512 grouped rows (16 and 64 tokens at top-8), 16- and 32-token ones above: row
    groups x chunks per k-step (the weight bytes a thread has in flight: 16 per row, chunk and group), the
    weights' cache hint on the smaller ones, one register-pipelined tile, and 2-8 chunks with every code load
    of the step issued first (weights_first; 3 chunks too, fc2's K = 768 in two steps). 32 token rows: an
    expert's weights read once where it has 17-32 rows (256 tokens: 16 a hit expert on average); 2-4 row groups
    there cut the activation bytes every warp reads per weight decoded (each warp holds all token rows). 8- and
    16-token tiles also with L2 prefetches and persistent CTAs (_streaming)."""
    first = [(4, 2), (4, 3), (4, 4), (4, 8), (8, 3), (8, 4)]
    if rows <= 512:
        return _candidates(8, [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)], first) + _streaming(8)
    out = _candidates(16, [(1, 1), (1, 2), (2, 2), (1, 4)], first) + _streaming(16)
    return out + _candidates(32, [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (1, 4)], [(4, 2), (4, 4), (8, 2)])


def _streaming(bt: int) -> list[dict]:
    """block_t = bt's usual fastest tiles (H100 and H200 sweeps of 2026-12-06/07) with L2 prefetches 4 chunks ahead,
    persistent CTAs (6 an SM), and both (the prefetches then run on into each CTA's next tile)."""
    base = [dict(chunks=2, weights_first=True), dict(chunks=4, weight_loads="evict_first")] if bt == 8 else [
        dict(chunks=1, weight_loads="evict_first")
    ]  # fmt: skip
    extra = [dict(l2_prefetch=4), dict(ctas_per_sm=6), dict(l2_prefetch=4, ctas_per_sm=6)]
    return [dataclasses.asdict(MmaConfig(block_t=bt, **b, **x)) for b in base for x in extra]


def _candidates(bt: int, shapes: list[tuple[int, int]], first: list[tuple[int, int]]) -> list[dict]:
    """block_t = bt: 4 and 8 warps x (row groups, chunks) shapes, the first two with each cache hint, one
    prefetch tile, and weights_first at (warps, chunks) of first."""
    out = [(bt, nw, rg, kc, False, "default") for nw in (4, 8) for rg, kc in shapes]
    out += [(bt, 4, rg, kc, False, wl) for wl in ("cg", "evict_first") for rg, kc in shapes[:2]]
    out.append((bt, 4, 2, 1, True, "default"))
    out = [(*t, False) for t in out]
    out += [(bt, nw, 1, kc, False, "default", True) for nw, kc in first]
    return [dataclasses.asdict(MmaConfig(**dict(zip(FIELDS, t, strict=True)))) for t in out]  # every field


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def baseline(rows: int, op_pairs, op_wgmma, offs, tok, w) -> tuple[str, float]:
    """The GEMM auto ran here before the decode-size one, and its time (us)."""
    from quads_megatron.kernels import gemm_wgmma_launch

    if tile_configs.wgmma_faster_than_triton(rows, "cuda") and gemm_wgmma_launch.usable(w[0].device, *_nk(w)):
        vals, dec = op_wgmma.values, op_wgmma.global_decode
        return "wgmma", bench(lambda: gemm_wgmma_launch.grouped_w4a4_wgmma(vals, dec, offs, *w, a_rows=tok))
    return "triton", bench(lambda: gemm_triton.grouped_w4a4(op_pairs, offs, *w, a_rows=tok))


def _nk(w) -> tuple[int, int]:
    return weight_layout.weight_dims(w[0], w[1])[1:3]


def tiled_ab(name: str, tokens: int, pairs, offs, a_rows, w, tiles: list[dict]) -> bool:
    """The best tiles again on weight_layout.tile_weights' layout (each 16-row group's chunk one contiguous
    block): its time beside the row-major one's in the same process, and whether the outputs are the same bits."""
    tw = weight_layout.tile_weights(w[0], w[1])
    gemm = functools.partial(gemm_mma_launch.grouped_w4a4_mma, pairs.values, pairs.global_decode, offs)
    ok = True
    for tile in tiles:
        cfg = MmaConfig(**tile)
        runs = {
            layout: functools.partial(gemm, *ww, a_rows=a_rows, config=cfg)
            for layout, ww in (("rows", w), ("tiled", (*tw, w[2])))
        }
        same = torch.equal(runs["rows"](), runs["tiled"]())
        ok &= same
        us = {k: bench(f) for k, f in runs.items()}
        print(
            f"  {name} tokens {tokens} tiled A/B {'/'.join(str(tile.get(f, False)) for f in SHOWN)}: "
            f"rows {us['rows']:.1f} us, tiled {us['tiled']:.1f} us ({us['rows'] / us['tiled']:.2f}x), same bits {same}",
            flush=True,
        )
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,32,64,128,256")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--write-config", action="store_true", help="write the winners into configs/mma_gemm.json")
    ap.add_argument("--no-tiled", dest="tiled", action="store_false", help="skip the tiled-weights A/B")
    ap.add_argument("--tiles", help="JSON list of MmaConfig field dicts to sweep instead of candidates()")
    ap.add_argument("--layout", choices=("rows", "tiled"), default="rows", help="the weights' layout swept on")
    args = ap.parse_args()
    given = [dataclasses.asdict(MmaConfig(**t)) for t in json.loads(args.tiles)] if args.tiles else None
    t0 = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    gemms = {}
    for name, (n, k) in (("fc1", (2 * INTER, HIDDEN)), ("fc2", (HIDDEN, INTER))):
        w = expert_weights(g, n, k)[1]
        gemms[name] = (n, k, (*weight_layout.tile_weights(w[0], w[1]), w[2]) if args.layout == "tiled" else w)
    runs = []  # (rule, rows, tile, us) for --write-config
    wins = []  # (rows, best mma fc1 + fc2, baseline fc1 + fc2)
    all_ok = True
    for tokens in (int(t) for t in args.tokens.split(",")):
        offs, tok, rows = fc1_rows(tokens, g)
        total_best, total_base = 0.0, 0.0
        for name, (n, k, w) in gemms.items():
            a_rows = tok if name == "fc1" else None
            x = (
                torch.randn(tokens if a_rows is not None else rows, k, generator=g, device="cuda")
                * torch.exp(torch.randn(k, generator=g, device="cuda"))
            ).bfloat16()
            pairs = act_quant.activation_operand(x)
            wg = act_quant.activation_operand(x, order="wgmma")
            want = gemm_triton.grouped_w4a4(pairs, offs, *w, a_rows=a_rows).float()[:rows]
            kind, base_us = baseline(rows, pairs, wg, offs, a_rows, w)
            rule, current = tile_configs.match_rule("mma_gemm", "cuda", rows=rows, k=k)
            res = []
            for tile in current_first(dataclasses.asdict(MmaConfig(**current["tile"])), given or candidates(rows)):
                if time.time() - t0 > args.budget_s:
                    print("budget spent; sweep cut short", flush=True)
                    break
                cfg = MmaConfig(**tile)
                if n % (16 * cfg.num_warps * cfg.row_groups):
                    continue

                def fn(cfg=cfg):
                    return gemm_mma_launch.grouped_w4a4_mma(
                        pairs.values, pairs.global_decode, offs, *w, a_rows=a_rows, config=cfg
                    )

                try:
                    got = fn().float()[:rows]
                except Exception as e:  # out of registers / shared memory: report and go on
                    print(f"{name} tokens {tokens} tile {tile} failed: {repr(e)[:160]}", flush=True)
                    continue
                ok = torch.allclose(got, want, rtol=1e-2, atol=1e-3 * want.abs().max().item())
                all_ok &= ok
                if not ok:
                    print(f"{name} tokens {tokens} tile {tile}: WRONG OUTPUT", flush=True)
                    continue
                us = bench(fn)
                res.append((us, tile))
                runs.append((rule, rows, tile, us))
            res.sort(key=lambda r: r[0])
            best = res[0][0] if res else float("nan")
            total_best += best
            total_base += base_us
            print(
                f"{name} tokens {tokens} rows {rows}: {kind} {base_us:.1f} us; mma best {best:.1f} us "
                f"({base_us / best:.2f}x); "
                + "; ".join(f"{u:.1f} {'/'.join(str(t.get(f, False)) for f in SHOWN)}" for u, t in res[:8]),
                flush=True,
            )
            if args.tiled and args.layout == "rows":
                all_ok &= tiled_ab(name, tokens, pairs, offs, a_rows, w, [t for _, t in res[:3]])
        wins.append((rows, total_best, total_base))
        print(f"tokens {tokens}: fc1 + fc2 mma {total_best:.1f} us vs {total_base:.1f} us", flush=True)
    print("every mma output matches the Triton GEMM:", all_ok, flush=True)
    if args.write_config and all_ok:
        path = write_config("mma_gemm", runs)
        used = 0
        for rows, best, base in sorted(wins):
            if not best < base:
                break
            used = rows
        with open(path) as f:
            table = json.load(f)
        key = tile_configs.device_key(torch.device("cuda"))
        table["devices"][key]["used_up_to_rows"] = used
        tile_configs.check_table("mma_gemm", table, path)
        with open(path, "w") as f:
            f.write(dumps_table(table) + "\n")
        tile_configs.load_table.cache_clear()
        print(f"used_up_to_rows {used} written: {path}", flush=True)
        assert os.path.dirname(path) == os.path.normpath(CONFIGS)
        print("moe_w4a4(impl='auto') at 16 tokens now runs:", tile_configs.mma_used(128, "cuda"), flush=True)


if __name__ == "__main__":
    main()
