"""Offline (no GPU): compile the Gluon Hopper W4A4 GEMM for sm_90 and report what its SASS does
(quads_megatron.kernels.sass_check.compile_wgmma_sm90).

    python dev/sass_wgmma.py 16,8,4,2,4 64,8,4,1,4 64,8,3,1,1,4,80 [--k 2048] [--json] [--dump DIR] [--shipped]

Per tile (token tile BT, warps, ring stages, 128-K chunks per step, k-steps per straight-line run;
then loader warps and the launch's register cap for the warp-specialized kernel, then 0/1 flags:
split, mask_rows, narrow, pdl, staged (persistent CTAs: the epilogue's scales staged by the loader),
tma_store): the A operand of each HGMMA (a register means the decoded weights feed wgmma directly), the
wgmma waits (0x1: the next decode overlaps the wgmma), the register hazards sass_check finds (a register
of an in-flight wgmma rewritten before its wait), spills, registers per thread, shared memory, the
output's TMA bulk stores (UTMASTG) and the K loop's instructions per thread and per decoded weight.
Warps 12 (with split): three consumer warpgroups on 192 weight rows. --shipped: also every tile the
data file configs/wgmma_gemm.json holds.
"""

from __future__ import annotations

import argparse
import json

from quads_megatron.kernels import tile_configs
from quads_megatron.kernels.sass_check import compile_wgmma_sm90
from quads_megatron.kernels.tile_configs import WgmmaConfig


def parse_tile(text: str) -> tuple[WgmmaConfig, bool]:
    """'BT,warps,stages,chunks[,unroll[,loader warps[,maxnreg[,split[,mask_rows[,narrow[,pdl[,staged
    [,tma_store]]]]]]]]]' -> (the tile, pdl)."""
    v = [int(x) for x in text.split(",")]
    bt, nw, st, kc, un = (v + [1])[:5]
    lw, cap, split, masked, narrow, pdl, staged, tma_store = (v[5:] + [0] * 8)[:8]
    tile = WgmmaConfig(
        block_t=bt, num_warps=nw, stages=st, chunks=kc, unroll=un, loader_warps=lw, maxnreg=cap or None,
        ctas_per_sm=int(bool(staged)), split=bool(split), mask_rows=bool(masked), narrow=bool(narrow),
        tma_store=bool(tma_store),
    )  # fmt: skip
    return tile, bool(pdl)


def shipped_tiles() -> list[WgmmaConfig]:
    """Every distinct tile of configs/wgmma_gemm.json, all devices."""
    table = tile_configs.load_table("wgmma_gemm")
    tiles = [WgmmaConfig(**r["tile"]) for entry in table["devices"].values() for r in entry["rules"]]
    return list(dict.fromkeys(tiles))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tiles", nargs="*", help=parse_tile.__doc__)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--json", action="store_true", help="one JSON list on stdout")
    ap.add_argument("--dump", default=None, help="also write the SASS here")
    ap.add_argument("--shipped", action="store_true", help="also the tiles of configs/wgmma_gemm.json")
    args = ap.parse_args()
    tiles = [parse_tile(t) for t in args.tiles] + [(t, False) for t in (shipped_tiles() if args.shipped else [])]
    out = [compile_wgmma_sm90(t, args.k, pdl, args.dump) for t, pdl in tiles]
    if args.json:
        print(json.dumps(out))
        return
    for r in out:
        print(
            f"{r['name']}: HGMMA {r['hgmma_shape']} A from "
            f"{'registers' if r['hgmma_a_operands'][0][0] == 'R' else 'smem'}, {r['threads']} threads"
            f", waits {r['wgmma_waits']}, {len(r['register_hazards'])} register hazards"
            f", spills {r['spills']}, {r['regs']} regs {r['setmaxnreg']}, {r['smem']} B smem, "
            f"loop {r['loop_instructions']} instructions ({r['per_weight']:.2f} per weight)"
        )


if __name__ == "__main__":
    main()
