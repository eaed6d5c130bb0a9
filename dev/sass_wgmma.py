"""Offline (no GPU): compile the Gluon Hopper W4A4 GEMM (kernels/w4a4_wgmma.py) for sm_90 and report
what its SASS does.

    python dev/sass_wgmma.py 16,8,4,2,4 64,8,4,1,4 64,8,3,1,1,4,80 [--k 2048] [--json] [--dump DIR]

Per tile (token tile BT, warps, ring stages, 128-K chunks per step, k-steps per straight-line run;
then loader warps and the launch's register cap for the warp-specialized kernel):
the A operand of each HGMMA (a register means the decoded weights feed wgmma directly), the wgmma
waits (0x1: the next decode overlaps the wgmma), the register hazards sass_hazards finds (a register
of an in-flight wgmma rewritten: what corrupted tiles on the H200 when a wgmma stayed in flight across
the loop's back edge), spills, registers per thread, shared memory, the output's TMA bulk stores
(UTMASTG: tma_store tiles) and the K loop's instructions per thread and per decoded weight. Warps 12
(with split): three consumer warpgroups on 192 weight rows. tests/test_wgmma_gemm.py runs this in a subprocess (Triton's
interpreter, used by the other CPU tests, must not share the process).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

# the checkout last: an installed quads_megatron (its kernels/ mapped in) wins over the source tree
sys.path.append(os.path.dirname(__file__))

SIGNATURE = {
    "a_ptr": "*fp16",
    "asdec_ptr": "*fp32",
    "w_ptr": "*u8",
    "ws_ptr": "*u8",
    "wsdec_ptr": "*fp32",
    "tmap_ptr": "*i32",
    "arows_ptr": "*i64",
    "y_ptr": "*bf16",
    "N": "i32",
    "wsdec_stride": "i32",
}
# the warp-specialized kernel's: y_desc after y_ptr (None unless TMA stores), the grid P last (persistent CTAs)
WS_SIGNATURE = {**{k: v for k, v in SIGNATURE.items() if k not in ("N", "wsdec_stride")}, "y_desc": "constexpr"}
WS_SIGNATURE.update(N="i32", wsdec_stride="i32", P="i32")


def y_descriptor_type(block_t: int) -> str:
    """The signature type of the warp-specialized kernel's y_desc (a TMA descriptor of bf16 [BT, 64] boxes)."""
    from quads_megatron.kernels import w4a4_wgmma as wg

    return f"tensordesc<bf16[{block_t}, 64],{wg.y_box_layout(block_t)!r}>"


def report(
    block_t: int,
    num_warps: int,
    stages: int,
    chunks: int = 1,
    unroll: int = 1,
    k: int = 2048,
    dump: str | None = None,
    loader_warps: int = 0,
    maxnreg: int | None = None,
    split: bool = False,
    mask_rows: bool = False,
    narrow: bool = False,
    pdl: bool = False,
    staged: bool = False,
    tma_store: bool = False,
) -> dict:
    import triton
    from sass_gemm_loop import registers_per_thread
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from quads_megatron.kernels import w4a4_wgmma as wg
    from quads_megatron.kernels.sass_hazards import disassemble, wgmma_register_hazards

    if loader_warps:  # the warp-specialized kernel: 1-step runs; unroll > 1: a slot's chunks overlap
        overlap, unroll = wg.ws_overlap(chunks, unroll), 1
        consts = dict(K=k, HAS_AROWS=True, BT=block_t, STAGES=stages, KC=chunks, NW=num_warps, OVERLAP=overlap)
        consts.update(MASK_ROWS=mask_rows, NARROW=narrow, A_I64=False, PDL=pdl, STAGED=staged)
        consts.update(wg.ws_launch_consts(block_t, num_warps, chunks, loader_warps, maxnreg, split))
        if not tma_store:
            consts["y_desc"] = None
    else:
        unroll = wg.run_length(k, chunks, unroll)
        consts = dict(K=k, HAS_AROWS=True, BT=block_t, STAGES=stages, KC=chunks, UNROLL=unroll, NW=num_warps)
        consts.update(MASK_ROWS=mask_rows, CODES_LAYOUT=wg._codes_layout(num_warps), num_warps=num_warps, PDL=pdl)
    launch_warps = consts.pop("num_warps")  # a compile option, not a constexpr
    signature = {
        **(WS_SIGNATURE if loader_warps else SIGNATURE),
        **dict.fromkeys(consts, "constexpr"),
        **({"y_desc": y_descriptor_type(block_t)} if tma_store else {}),
    }
    aligned = [i for i, name in enumerate(signature) if name.endswith("_ptr") or name == "N"]  # as at launch (N=1536)
    src = GluonASTSource(
        fn=wg._w4a4_wgmma_ws_kernel if loader_warps else wg._w4a4_wgmma_kernel,
        signature=signature,
        constexprs=consts,
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=launch_warps, **({"maxnreg": maxnreg} if maxnreg else {})),
    )
    sass = disassemble(compiled.asm["cubin"])  # whole (Triton's dump stops at 64 KB)
    if dump:
        os.makedirs(dump, exist_ok=True)
        name = f"wgmma_{block_t}_{num_warps}_{stages}_{chunks}_{unroll}_{loader_warps}" + ("_split" if split else "")
        name += ("_masked" if mask_rows else "") + ("_narrow" if narrow else "") + ("_pdl" if pdl else "")
        name += ("_staged" if staged else "") + ("_tma_store" if tma_store else "")
        with open(os.path.join(dump, name + ".sass"), "w") as out:
            out.write(sass)
        with open(os.path.join(dump, name + ".ptx"), "w") as out:
            out.write(compiled.asm["ptx"])
    lines = sass.splitlines()
    labels = {ln.strip()[:-1]: i for i, ln in enumerate(lines) if re.fullmatch(r"\w+:", ln.strip())}
    first_mma = next(i for i, ln in enumerate(lines) if "HGMMA" in ln)
    loop_end = next(  # the K loop's back edge: the first branch after the first wgmma that jumps above it
        i
        for i, ln in enumerate(lines)
        if i > first_mma and (b := re.search(r"BRA (\w+)", ln)) and labels[b.group(1)] < first_mma
    )
    loop_top = labels[re.search(r"BRA (\w+)", lines[loop_end]).group(1)]
    loop = [ln for ln in lines[loop_top + 1 : loop_end + 1] if ln.strip() and not ln.strip().endswith(":")]
    weights_per_thread = 64 * (num_warps // 4) * 128 * chunks * unroll // (32 * num_warps)
    return {
        "tile": f"BT{block_t} w{num_warps} s{stages} c{chunks} u{unroll}"
        + (f" ws{loader_warps}" + (" overlap" if consts["OVERLAP"] else "") if loader_warps else "")
        + (" split" if split else "")
        + (" masked rows" if mask_rows else "")
        + (" narrow" if narrow else "")
        + (" pdl" if pdl else "")
        + (" staged" if staged else "")
        + (" tma store" if tma_store else ""),
        "hgmma_a_operands": re.findall(r"HGMMA\.\S+ R\d+, (\S+), gdesc", sass),
        "hgmma_shape": sorted(set(re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass))),
        "wgmma_waits": re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass),
        "tma_stores": len(re.findall(r"\bUTMASTG\b", sass)),
        "register_hazards": wgmma_register_hazards(sass),
        "spills": len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\s", sass)),  # local-memory stores and loads
        # ... none inside the (consumer's) K loop; and stores only just before a partition gives registers
        # back (setmaxnreg.dec): the warp-specialized loader parks a few values there and reloads them
        "loop_spills": sum(1 for ln in loop if re.search(r"\b(?:STL|LDL)\b", ln)),
        "stores_at_handoff_only": all(
            any(0 < d - i <= 24 for d, dl in enumerate(lines) if "USETMAXREG.DEALLOC" in dl)
            for i, ln in enumerate(lines)
            if re.search(r"\bSTL\b", ln)
        ),
        "regs": registers_per_thread(compiled.asm["cubin"]),
        "threads": int(re.search(r"\.reqntid (\d+)", compiled.asm["ptx"]).group(1))
        if ".reqntid" in compiled.asm["ptx"]
        else 32 * num_warps,
        "setmaxnreg": re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"]),
        "smem": compiled.metadata.shared,
        "loop_instructions": len(loop),
        "per_weight": len(loop) / weights_per_thread,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "tiles",
        nargs="+",
        help="BT,warps,stages,chunks[,unroll[,loader warps (the warp-specialized kernel)[,maxnreg[,split 0/1"
        "[,mask_rows 0/1[,narrow 0/1[,pdl 0/1[,staged 0/1 (epilogue scales staged: persistent CTAs)"
        "[,tma_store 0/1 (full tiles leave by TMA bulk stores)]]]]]]]]]",
    )
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--json", action="store_true", help="one JSON list on stdout")
    ap.add_argument("--dump", default=None, help="also write the SASS here")
    args = ap.parse_args()
    out = []
    for t in args.tiles:
        v = [int(x) for x in t.split(",")]
        ws, cap, split, masked, narrow, pdl, staged, tma_store = (v[5:] + [0] * 8)[:8]
        kw = dict(loader_warps=ws, maxnreg=cap or None, split=bool(split), mask_rows=bool(masked), narrow=bool(narrow))
        kw.update(pdl=bool(pdl), staged=bool(staged), tma_store=bool(tma_store))
        out.append(report(*v[:5], k=args.k, dump=args.dump, **kw))
    if args.json:
        print(json.dumps(out))
        return
    for r in out:
        print(
            f"{r['tile']}: HGMMA {r['hgmma_shape']} A from "
            f"{'registers' if r['hgmma_a_operands'][0][0] == 'R' else 'smem'}, {r['threads']} threads"
            f", waits {r['wgmma_waits']}, {len(r['register_hazards'])} register hazards"
            f", spills {r['spills']}, {r['regs']} regs {r['setmaxnreg']}, {r['smem']} B smem, "
            f"loop {r['loop_instructions']} instructions ({r['per_weight']:.2f} per weight)"
        )


if __name__ == "__main__":
    main()
