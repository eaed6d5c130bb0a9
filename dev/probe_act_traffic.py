"""Device probe: where the prefill Gluon GEMM's time goes besides its consumers' decode and MMA: the
activation tile's L2 -> SM reads, the loader's copies, the weights' HBM latency, the epilogue.

python dev/probe_act_traffic.py [--tokens 4096,16384]
(CUDA GPU; CUDA-graph replay medians; Qwen3-30B-A3B fc1, token-indexed rows as moe_w4a4 runs fc1)

The warp-specialized Gluon GEMM at its shipped tiles (wgmma_config) next to scratch variants of its
loader partition (rewritten source, as dev/probe_wgmma_costs.py does):
  act rows 1/2 (1/4) read - only every 2nd (4th) activation row of a tile is read from L2, the others
                            zero-filled by the copy: L2 -> SM activation bytes / 2 (/ 4), shared-memory
                            writes unchanged (what FP4 activation codes in the ring would move, before
                            their decode);
  no act copies           - the activation tile is not copied at all (stale shared memory);
  no weight copies        - the code and scale bytes are not copied;
  no loads                - nothing copied: the consumers alone;
  act rows none read      - every activation row zero-filled by the copy (no L2 read, the same copies);
  weights of expert 0     - every tile reads expert 0's code and scale rows (L2 hits, no HBM latency);
  act rows of tile 0      - every tile reads the activation rows of grouped rows 0 .. BT - 1 (L2 hits);
  no epilogue             - the consumers skip each tile's output (scaling, layout change, stores;
                            the accumulator only summed, so that its wgmmas stay);
  epilogue stores off     - the epilogue's plain stores predicated off (run-time mask), the rest of it
                            kept (with tma_store: only the partial tiles' stores);
  prefetch ...            - the loader L2-prefetches the activation rows (and code rows) of a later
                            k-step when it issues one (cp.async.bulk.prefetch.L2, one row per thread).
and torch._grouped_mm (bf16) on the same rows; --baseline FILE: also an earlier copy of the kernel's device
code (gemm_wgmma.py), launched by the current launcher. python dev/probe_wgmma_costs.py --self-check also
checks this probe's rewrites.
The variants compute garbage; only their times mean anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

import torch

from quads_megatron.kernels import act_quant, tile_configs
from quads_megatron.kernels import gemm_wgmma_launch as wg

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import probe_wgmma_costs as costs  # noqa: E402
from probe_wgmma_tiles import HIDDEN, INTER, bench, expert_weights, fc1_rows  # noqa: E402

ROWS = "        b_rows = (r < row_end)[:, None]\n"
ACT_COPY, *_w_copies = costs.COPIES.splitlines(keepends=True)  # the loader's activation, code, scale copies
W_COPIES = "".join(_w_copies)
TILE_ROWS = "        r = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, b_copy))\n"
LOADER_DEF = "@gluon.jit\ndef _ws_loader(\n"
STEP_END = "            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)\n            it += 1\n"
PREFETCH_DEFS = "".join(  # L2 bulk prefetch of SIZE bytes at each pointer where ok != 0 (one per thread)
    f"""@gluon.jit
def _pf{size}(ptrs, ok):
    gl.inline_asm_elementwise(
        "{{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], {size}; mov.b32 $0, 0; }}",
        "=r,l,r", [ptrs, ok], dtype=gl.int32, is_pure=False, pack=1,
    )


"""
    for size in (128, 512)
)


def prefetch(ahead: int, weights: bool) -> list[tuple[str, str]]:
    """The loader also L2-prefetches the activation rows (and the code rows) of k-step j + ahead when it
    issues k-step j (2 chunks per step: 512 bytes per activation row, 128 per code row): one bulk
    prefetch per row and thread (BT = BNW = 128 rows, 4 loader warps)."""
    setup = (
        "        pf_l: gl.constexpr = gl.BlockedLayout([1], [32], [LW], [0])\n"
        "        pr = t0 + gl.arange(0, BT, layout=pf_l)\n"
        "        pf_a = a_ptr + gl.load(arows_ptr + pr, mask=pr < row_end, other=0).to(gl.int64) * K\n"
        "        pf_ok = (pr < row_end).to(gl.int32)\n"
        "        pf_w = w_ptr + (row0 + gl.arange(0, BNW, layout=pf_l).to(gl.int64)) * (K // 2)\n"
    )
    issue = (
        f"            jn = j + {ahead}\n"
        "            if jn < K // (128 * KC):\n"
        "                _pf512(pf_a + jn * 256, pf_ok)\n"
        + ("                _pf128(pf_w + jn * 128, pf_ok | 1)\n" if weights else "")
    )
    return [(LOADER_DEF, PREFETCH_DEFS + LOADER_DEF), (W_ROW0, W_ROW0 + setup), (STEP_END, STEP_END + issue)]


W_ROW0 = "        row0 = (e * N + (t % n_tiles) * BNW).to(gl.int64)\n"
STORE_MASK = "y, mask=(orow < row_end)[None, :])\n"
NO_EPILOGUE = (  # the accumulator kept alive (summed; stored only in a case that never happens), nothing written
    "    acc_sum = gl.sum(gl.sum(acc, axis=1), axis=0)\n"
    "    if acc_sum == 1.2345:\n"
    "        gl.store(y_ptr + t0, acc_sum.to(y_ptr.dtype.element_ty))\n"
    "    return it\n"
)
VARIANTS = {
    "act rows 1/2 read": [(ROWS, "        b_rows = ((r < row_end) & (r % 2 == 0))[:, None]\n")],
    "act rows 1/4 read": [(ROWS, "        b_rows = ((r < row_end) & (r % 4 == 0))[:, None]\n")],
    "no act copies": [(ACT_COPY, "")],
    "no weight copies": [(W_COPIES, "")],
    "no loads": costs.VARIANTS["no loads"],
    "act rows none read": [(ROWS, "        b_rows = (r < t0)[:, None]\n")],
    "weights of expert 0": [(W_ROW0, W_ROW0.replace("e * N + ", ""))],
    "no epilogue": [(costs.EPILOGUE, NO_EPILOGUE)],
    "epilogue stores off": [
        (STORE_MASK, STORE_MASK.replace("(orow < row_end)[None, :]", "((orow < row_end) & (orow < 0))[None, :]"))
    ],
    "no loads, no epilogue": [*costs.VARIANTS["no loads"], (costs.EPILOGUE, NO_EPILOGUE)],
    "act rows of tile 0": [(TILE_ROWS, TILE_ROWS.replace("t0 + ", ""))],
    "prefetch act 2 ahead": prefetch(2, False),
    "prefetch act 4 ahead": prefetch(4, False),
    "prefetch act + codes 2 ahead": prefetch(2, True),
    "weights of expert 0, act rows none read": [
        (ROWS, "        b_rows = (r < t0)[:, None]\n"),
        (W_ROW0, W_ROW0.replace("e * N + ", "")),
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--variants", default="", help="only the variants whose name this regex finds")
    ap.add_argument("--baseline", default="", help="also this file's copy of kernels/gemm_wgmma.py (A/B)")
    ap.add_argument("--cfg", default="", help="also the full kernel with these tile overrides: k=v,k=v;k=v")
    args = ap.parse_args()
    costs.VARIANTS.update(VARIANTS)
    mods = {"full": wg, **{name: costs.variant(name) for name in VARIANTS if re.search(args.variants, name)}}
    if args.baseline:
        mods["baseline"] = costs.load_variant(open(args.baseline).read(), open(wg.__file__).read(), "_probe_baseline")
    g = torch.Generator(device="cuda").manual_seed(0)
    w, (wc, wsc, wsd) = expert_weights(g)
    w_bt = w.transpose(-2, -1)
    for tokens in (int(t) for t in args.tokens.split(",")):
        offs, tok, rows = fc1_rows(tokens, g)
        x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
        perm = act_quant.activation_operand(x, order="wgmma")
        cfg = tile_configs.wgmma_config(rows, 2 * INTER, device="cuda")
        gemm_args = (perm.values, perm.global_decode, offs, wc, wsc, wsd)
        out = []
        y_full = wg.grouped_w4a4_wgmma(*gemm_args, a_rows=tok, config=cfg)  # what A/B pairs must reproduce
        if args.baseline:
            same = torch.equal(mods["baseline"].grouped_w4a4_wgmma(*gemm_args, a_rows=tok, config=cfg), y_full)
            out.append(f"baseline bit-identical {same}")
        for name, mod in mods.items():
            us = bench(lambda mod=mod: mod.grouped_w4a4_wgmma(*gemm_args, a_rows=tok, config=cfg))
            out.append(f"{name} {us:.1f}")
        for over in filter(None, args.cfg.split(";")):
            extra = {k: int(v) for k, v in (kv.split("=") for kv in over.split(","))}
            try:  # (flags given as 0/1 become bools)
                flags = {f.name for f in dataclasses.fields(cfg) if f.type in (bool, "bool")}
                other = dataclasses.replace(cfg, **{k: bool(v) if k in flags else v for k, v in extra.items()})
                us = bench(lambda other=other: wg.grouped_w4a4_wgmma(*gemm_args, a_rows=tok, config=other))
                # tile changes that keep each sum's order (stores, staging, warpgroups) keep the bits
                same = torch.equal(wg.grouped_w4a4_wgmma(*gemm_args, a_rows=tok, config=other), y_full)
                out.append(f"full {over} {us:.1f} (bit-identical to full: {same})")
            except Exception as e:  # e.g. a ring that does not fit in shared memory
                out.append(f"full {over} failed ({type(e).__name__})")
        xs = x[tok.long()].contiguous()
        out.append(f"bf16 torch._grouped_mm {bench(lambda: torch._grouped_mm(xs, w_bt, offs=offs)):.1f}")
        print(f"tokens {tokens} rows {rows} {cfg}: " + " | ".join(out) + " us", flush=True)


if __name__ == "__main__":
    main()
