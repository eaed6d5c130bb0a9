"""Device probe: where the warp-specialized Gluon GEMM's time goes (kernels/gemm_wgmma.py).

python dev/probe_wgmma_costs.py [--tokens 256,4096,16384] [--shipped]
(CUDA GPU; CUDA-graph replay medians; Qwen3-30B-A3B fc1, token-indexed rows as moe_w4a4 runs fc1)
python dev/probe_wgmma_costs.py --self-check
(any machine: every rewrite of this probe and of dev/probe_act_traffic.py still finds its text in the
kernel's source as often as it expects, and the rewritten modules load; run it after changing the kernel)

Times the kernel at its tuned tiles (consumers unsplit (two warpgroups), rows past the expert read from
row 0, no narrow tiles or TMA stores; below 1025 grouped rows the 256-token warp-specialized tile) next
to four scratch variants of its partitions, made by rewriting the source of gemm_wgmma.py and
gemm_wgmma_launch.py (so they always follow the shipped kernel; a rewrite that no longer matches raises):
  loads only  - the consumers wait for each slot and free it: the loader partition's own speed;
  no loads    - the loader arms each slot without copying (the consumers compute on stale shared
                memory): the consumer partition's own speed;
  no decode   - step 0's codes decoded once, those registers fed to every wgmma;
  no MMA      - the decoded operand summed into the accumulator instead of a wgmma;
  (and "no loads, no decode": the consumers' wgmma, waits and ring alone).
--shipped: also the variants at the shipped tiles (split consumers, zero-filled rows, narrow; the decode and
MMA rewrites fit only the unsplit consumer and report a compilation error there).
Also the loads-only variant on contiguous rows (one operand row per grouped row: no token gather), the
loads-only variant stripped step by step towards dev/probe_load_paths.py (no epilogue; the
256-token tiles from the program id alone; an exact grid; the load probe's loader registers; its
unswizzled activation ring), the tile-map launch alone, the kernel and its consumers alone with split
consumers (one partition per warpgroup) and with rows past the expert zero-filled by the copy (not
read from row 0), and at 256 tokens the load probe's kernel on this GEMM's codes and on random ones.
The variants compute garbage; only their times mean anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
import tempfile

import torch
import triton

from quads_megatron.kernels import act_quant, gemm_wgmma, row_tiles, tile_configs
from quads_megatron.kernels import gemm_wgmma_launch as wg

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from probe_wgmma_tiles import HIDDEN, INTER, bench, expert_weights, fc1_rows  # noqa: E402

FENCE = """        hopper.fence_async_shared()  # the cp.async writes are visible to wgmma's (async proxy) reads
"""
STEP = """        for ch in gl.static_range(KC):
            acc = _decode_and_mma(b_smem, w_smem, s_smem, slot * KC + ch, acc, BNW, CODES_LAYOUT, ROW0)
            if OVERLAP and ch < KC - 1:
                acc = hopper.warpgroup_mma_wait(1, deps=[acc])
            else:
                acc = hopper.warpgroup_mma_wait(0, deps=[acc])
"""
LOOP_HEAD = """    for _ in range(K // (128 * KC)):
"""  # the warp-specialized consumer's K loop head (unique: the one-partition kernel loops over runs)
A_LAYOUT = "gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)"
DECODE = """_decode_a(w_smem.index({s}).reshape([BNW, 8, 8]).load(CODES_LAYOUT),
                      s_smem.index({s}).load(gl.SliceLayout(2, CODES_LAYOUT)), BNW, {layout})"""
COPIES = """\
                async_copy.async_copy_global_to_shared(b_smem.index(buf), (a_ptr + c * 128) + b_off, mask=b_mask)
                for pc in gl.static_range(BNW // PIECE):  # weight rows in pieces (192: three of 64)
                    w_dst = w_smem.index(buf).slice(pc * PIECE, PIECE)
                    s_dst = s_smem.index(buf).slice(pc * PIECE, PIECE)
                    prow = row0 + pc * PIECE
                    async_copy.async_copy_global_to_shared(w_dst, (w_ptr + prow * (K // 2) + c * 64) + w_off)
                    async_copy.async_copy_global_to_shared(s_dst, (ws_ptr + prow * (K // 16) + c * 8) + s_off)
"""  # the loader's copies of a chunk: activation rows (the first line), then the code and scale bytes
EPILOGUE = """    if y_desc is None:
        _store_tile(acc, sa, sw, y_ptr, t0, n0, row_end, N, BT, NW, mma)
    else:
        _store_tile_tma(acc, sa, sw, y_ptr, y_desc, y_smem.index(ROW0 // 64), t0, n0, row_end, N, BT, mma)
    return it
"""  # the consumer tile's output, plain or TMA stores (the scales it reads are dropped with it)
LOOKUP = "    return gl.load(tmap_ptr + pid * 4), gl.load(tmap_ptr + pid * 4 + 1), gl.load(tmap_ptr + pid * 4 + 2)\n"
FIXED = "    return pid % 128, (pid % 128) * 16, (pid % 128) * 16 + 16  # probe: 128 experts x 16 rows, no lookup\n"
BOUND = "gl.load(tmap_ptr + 3) * n_tiles"
B_LAYOUT = "gl.NVMMASharedLayout.get_default_for([BT, 128], gl.float16)"
GRID = "gemm_ctas(tiles_ub, dev, cfg.ctas_per_sm)"
LOADER_REGS = "loader_regs = ws_loader_regs(block_t, loader_warps, chunks, ROWS_PER_WARPGROUP * num_warps // 4)"
FIXED_TILES = [
    (FENCE + STEP, ""),
    (EPILOGUE, "    return it\n"),
    (LOOKUP, FIXED),
    (BOUND, "128 * n_tiles", 2),  # the tile loops of the loader and the consumers
]
VARIANTS = {
    "loads only": [(FENCE + STEP, "")],
    "loads only, no epilogue": [(FENCE + STEP, ""), (EPILOGUE, "    return it\n")],
    # the 256-token workload's tiles (128 experts x 16 rows) from pid alone: no tile-map or row-count load
    "loads only, no epilogue, fixed tiles": FIXED_TILES,
    # ... and a grid of exactly those 1536 tiles (the host launches the row-tile bound: 768 more, empty)
    "loads only, no epilogue, fixed tiles, exact grid": [
        *FIXED_TILES,
        (GRID, "gemm_ctas(128 * grid[0], dev, cfg.ctas_per_sm)"),
    ],
    # ... and the load probe's loader register budget (dev/probe_load_paths.py: 88)
    "loads only, no epilogue, fixed tiles, loader regs 88": [*FIXED_TILES, (LOADER_REGS, "loader_regs = 88")],
    # ... and the activation ring unswizzled, as the load probe's (loads only: wgmma never reads it)
    "loads only, no epilogue, fixed tiles, plain activation ring": [*FIXED_TILES, (B_LAYOUT, "plain")],
    "no loads": [(COPIES, "                pass\n")],
    "no decode": [
        (
            LOOP_HEAD,
            "    mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)\n"
            + "    a = "
            + DECODE.format(s="(it % STAGES) * KC", layout=A_LAYOUT)
            + "\n"
            + LOOP_HEAD,
        ),
        (
            STEP,
            "        for ch in gl.static_range(KC):\n"
            "            b = b_smem.index(slot * KC + ch).permute((1, 0))\n"
            "            acc = hopper.warpgroup_mma(a, b, acc, is_async=True)\n"
            "            acc = hopper.warpgroup_mma_wait(0, deps=[acc])\n",
        ),
    ],
    "no loads, no decode": [],  # filled in below: both rewrites
    "no MMA": [
        (
            STEP,
            "        for ch in gl.static_range(KC):\n"
            "            a = "
            + DECODE.format(s="slot * KC + ch", layout=A_LAYOUT)
            + "\n            acc += gl.convert_layout(gl.sum(a.to(gl.float32), axis=1),"
            + " gl.SliceLayout(1, mma))[:, None]\n",
        )
    ],
}


VARIANTS["no loads, no decode"] = VARIANTS["no loads"] + VARIANTS["no decode"]


DEVICE_IMPORT = "from quads_megatron.kernels.gemm_wgmma import ("  # the launcher's import of the device code


def rewrite(name: str, device_src: str | None = None) -> tuple[str, str]:
    """(device source, launcher source) of the Gluon GEMM with VARIANTS[name]'s rewrites applied to both;
    each rewrite's text must occur as often as it says (1 unless given) in the two together."""
    dev = open(gemm_wgmma.__file__).read() if device_src is None else device_src
    host = open(wg.__file__).read()
    for old, new, *count in VARIANTS[name]:  # (text, replacement[, how many times it must occur: 1])
        if dev.count(old) + host.count(old) != (count[0] if count else 1):
            raise RuntimeError(f"{name}: the kernel no longer matches this probe's rewrite of {old[:60]!r}")
        dev, host = dev.replace(old, new), host.replace(old, new)
    return dev, host


def variant(name: str):
    """The launcher module of a variant: VARIANTS[name]'s rewrites, its device code loaded beside it."""
    return load_variant(*rewrite(name), "_probe_" + re.sub(r"\W+", "_", name))


def load_variant(device_src: str, host_src: str, name: str):
    """Load device code and a launcher that imports it (rewritten sources, or an earlier copy of the device
    code for an A/B) as quads_megatron.kernels.<name>_device and .<name>; returns the launcher."""
    if host_src.count(DEVICE_IMPORT) != 1:
        raise RuntimeError("the launcher no longer imports its device code as this probe expects")
    load_source(_write(device_src), f"{name}_device")
    host_src = host_src.replace(DEVICE_IMPORT, f"from quads_megatron.kernels.{name}_device import (")
    return load_source(_write(host_src), name)


def _write(src: str) -> str:
    path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False).name  # Gluon reads the source file
    with open(path, "w") as f:
        f.write(src)
    return path


def load_source(path: str, name: str):
    """A module from a source file as quads_megatron.kernels.<name>."""
    spec = importlib.util.spec_from_file_location(f"quads_megatron.kernels.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def self_check() -> bool:
    """Every variant of this probe and of probe_act_traffic.py rewrites the current kernel and loads (no GPU)."""
    import probe_act_traffic as traffic

    ok = {"loads only", "no loads", "no decode", "no MMA"} <= set(VARIANTS)
    for name, rewrites in {**traffic.VARIANTS, **VARIANTS}.items():
        VARIANTS.setdefault(name, rewrites)
        try:
            mod = variant(name)
            good = mod.__file__ != wg.__file__ and callable(mod.grouped_w4a4_wgmma)
        except Exception as e:  # report every variant, then fail
            good = False
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
        print(f"{'ok  ' if good else 'FAIL'} {name}", flush=True)
        ok &= good
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,4096,16384")
    ap.add_argument("--shipped", action="store_true", help="also at the shipped tiles (split, zero-filled)")
    ap.add_argument("--self-check", action="store_true", help="only check that every rewrite still applies")
    args = ap.parse_args()
    if args.self_check:
        sys.exit(0 if self_check() else 1)
    mods = {"full": wg, **{name: variant(name) for name in VARIANTS}}
    g = torch.Generator(device="cuda").manual_seed(0)
    _, (wc, wsc, wsd) = expert_weights(g)
    for tokens in (int(t) for t in args.tokens.split(",")):
        offs, tok, rows = fc1_rows(tokens, g)
        x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
        perm = act_quant.activation_operand(x, order="wgmma")
        shipped = tile_configs.wgmma_config(rows, 2 * INTER, device="cuda")  # split consumers, zero-filled rows
        # the variants rewrite the unsplit consumer (two warpgroups); rows past the expert read from row 0 (the
        # default zero-fills them: below); full tiles, plain stores
        cfg = dataclasses.replace(shipped, split=False, mask_rows=False, narrow=False, tma_store=False)
        if cfg.num_warps == 12:
            cfg = dataclasses.replace(cfg, num_warps=8)
        if not cfg.loader_warps:  # up to 1024 rows the default is the one-partition kernel
            cfg = dataclasses.replace(cfg, block_t=32, stages=3, chunks=2, loader_warps=4, maxnreg=80, ctas_per_sm=0)
        out = []
        for name, mod in mods.items():
            if "fixed tiles" in name and tokens != 256:  # FIXED is the 256-token workload's tiles
                continue
            us = bench(
                lambda mod=mod: mod.grouped_w4a4_wgmma(
                    perm.values, perm.global_decode, offs, wc, wsc, wsd, a_rows=tok, config=cfg
                )
            )
            out.append(f"{name} {us:.1f}")
        for name, label, extra in (  # each consumer warpgroup its own partition (not kept in step); rows
            ("full", "split consumers", dict(split=True)),  # past the expert zero-filled, not read from row 0
            ("no loads", "split consumers", dict(split=True)),
            ("full", "zero-filled rows", dict(mask_rows=True)),
            ("full", "split consumers, zero-filled rows", dict(split=True, mask_rows=True)),
            ("loads only", "zero-filled rows", dict(mask_rows=True)),
        ):
            us = bench(
                lambda mod=mods[name], extra=extra: mod.grouped_w4a4_wgmma(
                    perm.values,
                    perm.global_decode,
                    offs,
                    wc,
                    wsc,
                    wsd,
                    a_rows=tok,
                    config=dataclasses.replace(cfg, **extra),
                )
            )
            out.append(f"{name}, {label} {us:.1f}")
        if shipped.loader_warps and args.shipped:
            for name in ("loads only", "no loads", "no decode", "no MMA", "no loads, no decode"):
                try:
                    us = bench(
                        lambda mod=mods[name]: mod.grouped_w4a4_wgmma(
                            perm.values, perm.global_decode, offs, wc, wsc, wsd, a_rows=tok, config=shipped
                        )
                    )
                    out.append(f"{name}, shipped tiles {us:.1f}")
                except Exception as e:  # a rewrite that does not fit the split consumer
                    out.append(f"{name}, shipped tiles failed ({type(e).__name__})")
        bt = cfg.block_t
        tm = triton.cdiv(rows, bt) + offs.numel()
        out.append(f"tile map alone {bench(lambda bt=bt, tm=tm: row_tiles.tile_map(offs, bt, tm)):.1f}")
        rows_op = perm.values[tok.long()].contiguous(), perm.global_decode.reshape(-1)[tok.long()].contiguous()
        for name in ("loads only",) + (("loads only, no epilogue, fixed tiles",) if tokens == 256 else ()):
            us = bench(lambda name=name: mods[name].grouped_w4a4_wgmma(*rows_op, offs, wc, wsc, wsd, config=cfg))
            out.append(f"{name}, contiguous rows {us:.1f}")
        if tokens == 256:  # the load probe's kernel (probe_load_paths.py) on this GEMM's codes and scales
            from probe_load_paths import stream

            codes, scales = wc.view(-1, HIDDEN // 2), wsc.view(-1, HIDDEN // 16)
            acts = torch.randn(wc.shape[0] * 32, HIDDEN, device="cuda").half()
            for data, c in (("this GEMM's", codes), ("random", torch.randint_like(codes, 256))):
                us = bench(lambda c=c: stream(c, scales, acts, "rows", 128, 128, True, 32, 3, 4, 0, 8, 80))
                out.append(f"load probe (CB128 BT32 s3 w8 r80) on {data} codes {us:.1f}")
        keys = ("block_t", "num_warps", "stages", "chunks", "loader_warps", "maxnreg", "ctas_per_sm")
        tiles = {k: getattr(cfg, k) for k in keys}
        print(f"tokens {tokens} rows {rows} {tiles}: " + " | ".join(out) + " us", flush=True)


if __name__ == "__main__":
    main()
