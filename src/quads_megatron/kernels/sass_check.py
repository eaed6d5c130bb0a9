"""Static checks of compiled sm_90 code, and an offline sm_90 compile of the Gluon GEMM.

wgmma (SASS ``HGMMA``) reads its register A operand and updates its accumulators asynchronously; only
a later ``WARPGROUP.DEPBAR.LE gsb0, N`` (PTX wgmma.wait_group N) makes them safe to touch. ptxas keeps
those registers alive across straight-line code, but across a loop's back edge (wgmma in one iteration,
its wait in the next) it may reuse them. wgmma_register_hazards walks every path from each HGMMA to the
wait that retires its group and reports any other instruction that writes one of its registers; the
Gluon GEMM's launcher runs it on each kernel it compiles. disassemble reads the whole cubin with the
cuobjdump Triton bundles (Triton's own ``asm["sass"]`` parser expects 4-digit offsets, so it misses
code past 64 KB). compile_wgmma_sm90 compiles a tile for sm_90 without a GPU and reports what its SASS
does; ``python -m quads_megatron.kernels.sass_check '<JSON list of WgmmaConfig fields>'`` prints those
reports as JSON (a fresh process: Triton's interpreter, once on, patches the language for the process).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

# opcodes without a register destination in the first operand slot
_NO_DEST = {
    "BAR", "BRA", "BSSY", "BSYNC", "CCTL", "DEPBAR", "ERRBAR", "EXIT", "FENCE", "LDGDEPBAR",
    "LDGSTS", "MEMBAR", "NOP", "RED", "RET", "ST", "STG", "STL", "STS", "STSM", "SYNCS", "WARPGROUP",
}  # fmt: skip
_GUARD = re.compile(r"^@!?U?P[T\d]+\s+")
_HGMMA = re.compile(r"HGMMA\.64x(\d+)x\d+\.\S+ R(\d+), (R(\d+)|gdesc)")
_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d+)")
_BRANCH = re.compile(r"^(@!?P[T\d]+\s+)?BRA (\w+)")


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;\s*/\* 0x([0-9a-f]{16}) \*/\s*$")
_SECOND_WORD = re.compile(r"^\s*/\* 0x([0-9a-f]{16}) \*/\s*$")
_BRA_TARGET = re.compile(r"^(.*\bBRA\b.*?)(0x[0-9a-f]+)$")


def _control(word: int) -> str:
    """Control bits of an sm_70+ instruction (its second 64-bit word) as wait:read:write:yield:stall,
    the form Triton's dump prints ("-": no barrier; "Y": yield)."""
    stall, no_yield = (word >> 41) & 0xF, (word >> 45) & 1
    write, read, wait = (word >> 46) & 7, (word >> 49) & 7, (word >> 52) & 0x3F
    bar = lambda b: "-" if b == 7 else str(b)  # noqa: E731
    return f"{'--' if wait == 0 else f'{wait:02d}'}:{bar(read)}:{bar(write)}:{'-' if no_yield else 'Y'}:{stall:x}"


def parse_cuobjdump(text: str) -> str:
    """``cuobjdump -sass`` output of one kernel -> "control<TAB>instruction;" lines, branch targets as
    labels (``L<hex offset>:``), every instruction whatever its offset's width. RuntimeError when no
    instruction is found or an instruction lacks its second word."""
    lines = text.splitlines()
    code = []  # (offset, instruction, control)
    for i, line in enumerate(lines):
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        second = _SECOND_WORD.match(lines[i + 1]) if i + 1 < len(lines) else None
        if second is None:
            raise RuntimeError(f"cuobjdump output: no second word after {line.strip()!r}")
        code.append((int(m.group(1), 16), m.group(2).strip(), _control(int(second.group(1), 16))))
    if not code:
        raise RuntimeError("cuobjdump output has no SASS instructions")
    branches = [_BRA_TARGET.match(ins) for _, ins, _ in code]
    targets = {int(b.group(2), 16) for b in branches if b}
    out = []
    for (offset, ins, ctrl), b in zip(code, branches, strict=True):
        if offset in targets:
            out.append(f"L{offset:x}:")
        out.append(f"{ctrl}\t{b.group(1)}L{int(b.group(2), 16):x};" if b else f"{ctrl}\t{ins};")
    return "\n".join(out) + "\n"


def cuobjdump(cubin: bytes, option: str) -> str:
    """stdout of the cuobjdump Triton bundles run with one option (-sass, -res-usage) on a cubin.
    OSError / CalledProcessError where that cannot run."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run(
            [knobs.nvidia.cuobjdump.path, option, path], capture_output=True, text=True, check=True
        ).stdout


def disassemble(cubin: bytes) -> str:
    """A compiled kernel's cubin -> its whole SASS (parse_cuobjdump). OSError / CalledProcessError
    where cuobjdump cannot run, RuntimeError where its output has no code."""
    return parse_cuobjdump(cuobjdump(cubin, "-sass"))


def _program(sass: str) -> list[tuple[str, str]]:
    """("label", name) / ("ins", text without control codes, guard kept) in program order."""
    prog = []
    for line in sass.splitlines():
        text = line.split("\t", 1)[-1].strip().rstrip(";").strip()
        if not text or text.startswith(("//", ".")):
            continue
        prog.append(("label", text[:-1]) if re.fullmatch(r"\w+:", text) else ("ins", text))
    return prog


def _written(ins: str) -> set[int]:
    """General registers an instruction writes: its first operand (SHFL: the second, after the
    predicate), .64/.WIDE two, .128 four, LDSM .M88.n n."""
    body = _GUARD.sub("", ins)
    op, _, rest = body.partition(" ")
    if op.split(".")[0] in _NO_DEST or not rest:
        return set()
    operands = [o.strip() for o in rest.split(",")]
    dest = re.fullmatch(r"R(\d+)", operands[1 if op.startswith("SHFL") and len(operands) > 1 else 0])
    if dest is None:
        return set()
    ldsm = re.search(r"\.M88\.(\d)", op)
    width = int(ldsm.group(1)) if ldsm else 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    return set(range(int(dest.group(1)), int(dest.group(1)) + width))


def wgmma_register_hazards(sass: str, max_groups: int = 16) -> list[str]:
    """One line per (HGMMA, instruction) pair where the instruction, on some path after the HGMMA and
    before the wait that retires the HGMMA's commit group, writes its A registers (R a .. a+3) or its
    accumulators (R d .. d+N/2-1). Empty: no such write on any path."""
    prog = _program(sass)
    labels = {name: i for i, (kind, name) in enumerate(prog) if kind == "label"}
    found = []
    for start, (kind, ins) in enumerate(prog):
        m = _HGMMA.match(_GUARD.sub("", ins)) if kind == "ins" else None
        if m is None:
            continue
        regs = set(range(int(m.group(2)), int(m.group(2)) + int(m.group(1)) // 2))
        if m.group(4) is not None:
            regs |= set(range(int(m.group(4)), int(m.group(4)) + 4))
        # state: (pc, own group committed, groups committed after it)
        todo, seen = [(start + 1, "gsb0" in ins, 0)], set()
        while todo:
            state = todo.pop()
            pc, committed, after = state
            if state in seen or pc >= len(prog) or after > max_groups:
                continue
            seen.add(state)
            kind, text = prog[pc]
            if kind == "label":
                todo.append((pc + 1, committed, after))
                continue
            body = _GUARD.sub("", text)
            if body.startswith("HGMMA"):
                if "gsb0" in body:
                    after, committed = after + committed, True
            elif _written(text) & regs:
                found.append(f"{ins} <- {text} (instruction {pc})")
                continue
            wait = _WAIT.match(body)
            if (wait and committed and after >= int(wait.group(1))) or text.startswith("EXIT"):
                continue  # retired (or the thread ends; a guarded EXIT may fall through)
            branch = _BRANCH.match(text)
            if branch:
                todo.append((labels[branch.group(2)], committed, after))
                if branch.group(1):
                    todo.append((pc + 1, committed, after))
                continue
            todo.append((pc + 1, committed, after))
    return found


def registers_per_thread(cubin: bytes) -> int | None:
    """Registers per thread of a compiled kernel (cuobjdump -res-usage)."""
    regs = re.search(r"REG:(\d+)", cuobjdump(cubin, "-res-usage"))
    return int(regs.group(1)) if regs else None


# the Gluon GEMM's runtime arguments as compiled (pointers 16-byte aligned, as at launch with N = 1536)
_SIGNATURE = {
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
# the decode-size GEMM's: the grid P last (persistent CTAs)
_MMA_SIGNATURE = {**_SIGNATURE, "P": "i32"}
# the warp-specialized kernel's: y_desc after y_ptr (None unless TMA stores), the grid P last (persistent CTAs)
_WS_SIGNATURE = {**{k: v for k, v in _SIGNATURE.items() if k not in ("N", "wsdec_stride")}, "y_desc": "constexpr"}
_WS_SIGNATURE.update(N="i32", wsdec_stride="i32", P="i32")


def compile_wgmma_sm90(tile, k: int = 2048, pdl: bool = False, dump: str | None = None, tiled: bool = False) -> dict:
    """Compile the Gluon GEMM at tile (a tile_configs.WgmmaConfig; bf16 output, token-indexed rows, K=k; tiled:
    on weight_layout's tiled weights)
    for sm_90 with Triton's ptxas, no GPU needed, and report its SASS: the HGMMA shapes and A operands (a
    register: the decoded weights feed wgmma directly), the wgmma waits (0x1: the next decode overlaps the
    wgmma), register hazards, spills (all, inside the K loop, and whether stores sit only just before a
    partition gives registers back), registers per thread, threads, setmaxnreg, shared memory, TMA bulk
    stores and the K loop's instructions per decoded weight. dump: also write the SASS and PTX there."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from quads_megatron.kernels import gemm_wgmma as dev
    from quads_megatron.kernels import gemm_wgmma_launch as host

    t = tile
    staged = t.ctas_per_sm > 0
    if t.loader_warps:  # the warp-specialized kernel: 1-step runs; unroll > 1: a slot's chunks overlap
        overlap, unroll = host.ws_overlap(t.chunks, t.unroll), 1
        consts = dict(K=k, HAS_AROWS=True, BT=t.block_t, STAGES=t.stages, KC=t.chunks, NW=t.num_warps)
        consts.update(OVERLAP=overlap, MASK_ROWS=t.mask_rows, NARROW=t.narrow, A_I64=False, PDL=pdl, STAGED=staged)
        consts.update(TILED=tiled, L2_AHEAD=t.l2_prefetch)
        consts.update(host.ws_launch_consts(t.block_t, t.num_warps, t.chunks, t.loader_warps, t.maxnreg, t.split))
        if not t.tma_store:
            consts["y_desc"] = None
    else:
        overlap, unroll = False, host.run_length(k, t.chunks, t.unroll)
        consts = dict(K=k, HAS_AROWS=True, BT=t.block_t, STAGES=t.stages, KC=t.chunks, UNROLL=unroll, NW=t.num_warps)
        consts.update(MASK_ROWS=t.mask_rows, CODES_LAYOUT=dev.codes_layout(t.num_warps), num_warps=t.num_warps)
        consts.update(PDL=pdl, TILED=tiled)
    launch_warps = consts.pop("num_warps")  # a compile option, not a constexpr
    signature = {**(_WS_SIGNATURE if t.loader_warps else _SIGNATURE), **dict.fromkeys(consts, "constexpr")}
    if t.tma_store:
        signature["y_desc"] = f"tensordesc<bf16[{t.block_t}, 64],{dev.y_box_layout(t.block_t)!r}>"
    aligned = [i for i, name in enumerate(signature) if name.endswith("_ptr") or name == "N"]
    src = GluonASTSource(
        fn=dev.w4a4_wgmma_ws_kernel if t.loader_warps else dev.w4a4_wgmma_kernel,
        signature=signature,
        constexprs=consts,
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    options = dict(num_warps=launch_warps, **({"maxnreg": t.maxnreg} if t.maxnreg else {}))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    sass = disassemble(compiled.asm["cubin"])
    name = f"wgmma_{t.block_t}_{t.num_warps}_{t.stages}_{t.chunks}_{unroll}_{t.loader_warps}"
    flags = (("split", t.split), ("masked", t.mask_rows), ("narrow", t.narrow), ("pdl", pdl), ("staged", staged))
    flags += (("tiled", tiled),)
    name += "".join(f"_{flag}" for flag, on in (*flags, ("tma_store", t.tma_store)) if on)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in ((".sass", sass), (".ptx", compiled.asm["ptx"])):
            with open(os.path.join(dump, name + ext), "w") as out:
                out.write(text)
    lines = sass.splitlines()
    loop = _k_loop(lines, r"HGMMA")  # the K loop's back edge: the first branch after the first wgmma jumping above it
    weights_per_thread = 64 * (t.num_warps // 4) * 128 * t.chunks * unroll // (32 * t.num_warps)
    ptx = compiled.asm["ptx"]
    reqntid = re.search(r"\.reqntid (\d+)", ptx)
    return {
        "name": name,
        "overlap": overlap,
        "unroll": unroll,
        "hgmma_a_operands": re.findall(r"HGMMA\.\S+ R\d+, (\S+), gdesc", sass),
        "hgmma_shape": sorted(set(re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass))),
        "wgmma_waits": re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass),
        "l2_prefetches": sass.count("CCTL.E.PF2"),  # prefetch.global.L2 (the loader, l2_prefetch)
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
        "threads": int(reqntid.group(1)) if reqntid else 32 * t.num_warps,
        "setmaxnreg": re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx),
        "smem": compiled.metadata.shared,
        "loop_instructions": len(loop),
        "per_weight": len(loop) / weights_per_thread,
    }


def _k_loop(lines: list[str], first: str) -> list[str]:
    """The instructions of the K loop of parse_cuobjdump lines: from the label the first branch after the
    first instruction matching `first` jumps back to, through that branch."""
    labels = {ln.strip()[:-1]: i for i, ln in enumerate(lines) if re.fullmatch(r"\w+:", ln.strip())}
    first_i = next(i for i, ln in enumerate(lines) if re.search(first, ln))
    loop_end = next(
        i
        for i, ln in enumerate(lines)
        if i > first_i and (b := re.search(r"BRA (\w+)", ln)) and labels[b.group(1)] < first_i
    )
    loop_top = labels[re.search(r"BRA (\w+)", lines[loop_end]).group(1)]
    return [ln for ln in lines[loop_top + 1 : loop_end + 1] if ln.strip() and not ln.strip().endswith(":")]


def compile_mma_sm90(tile, k: int = 2048, pdl: bool = False, tiled: bool = False) -> dict:
    """Compile the decode-size Gluon GEMM (gemm_mma) at tile (a tile_configs.MmaConfig; bf16 output,
    token-indexed rows, K=k; tiled: on weight_layout.tile_weights' layout) for sm_90 with Triton's ptxas, no
    GPU needed, and report its SASS: the HMMA shapes and how many the K loop issues, its global loads by
    width, shared memory, local memory (spills), registers per thread and the K loop's instructions per
    decoded weight."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from quads_megatron.kernels import gemm_mma as dev
    from quads_megatron.kernels import gemm_mma_launch as host

    t = tile
    chunks = host.fit_tile(t, 16 * t.num_warps * t.row_groups, k)
    consts = dict(K=k, HAS_AROWS=True, BT=t.block_t, NW=t.num_warps, RG=t.row_groups, KC=chunks, PDL=pdl)
    consts.update(
        TILED=tiled,
        WEIGHTS_FIRST=t.weights_first,
        L2_AHEAD=t.l2_prefetch,
        PERSIST=t.ctas_per_sm > 0,
        CODES_LAYOUT=dev.codes_layout(t.num_warps, t.row_groups),
        X_LAYOUT=dev.activation_layout(t.num_warps, t.block_t),
        C16_LAYOUT=dev.codes16_layout(t.num_warps, t.row_groups),
        PREFETCH=t.prefetch,
        WEIGHT_LOADS=t.weight_loads,
        WORDS_LAYOUT=dev.words_layout(t.num_warps, t.row_groups),
    )
    signature = {**_MMA_SIGNATURE, **dict.fromkeys(consts, "constexpr")}
    aligned = [i for i, name in enumerate(signature) if name.endswith("_ptr") or name == "N"]
    src = GluonASTSource(
        fn=dev.w4a4_mma_kernel,
        signature=signature,
        constexprs=consts,
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=t.num_warps))
    lines = disassemble(compiled.asm["cubin"]).splitlines()
    loop = _k_loop(lines, r"HMMA")
    weights_per_thread = 16 * t.row_groups * 128 * (1 if t.prefetch else chunks) // 32
    return {
        "hmma_shape": sorted(set(re.findall(r"HMMA\.(\d+)\.F32", "\n".join(lines)))),
        "loop_hmma": sum(1 for ln in loop if "HMMA" in ln),
        "loop_loads": sorted(set(re.findall(r"\bLDG\.E(?:\.(\w+))?", "\n".join(loop)))),
        "loop_load_ops": sorted(set(re.findall(r"\bLDG\.E[.\w]*", "\n".join(loop)))),
        "loop_shared": sum(1 for ln in loop if re.search(r"\b(?:LDS|STS|LDSM|BAR)\b", ln)),
        "loop_l2_prefetch": sum(1 for ln in loop if "CCTL.E.PF2" in ln),  # prefetch.global.L2
        "spills": sum(1 for ln in lines if re.search(r"\b(?:STL|LDL)(?:\.\w+)*\s", ln)),
        "regs": registers_per_thread(compiled.asm["cubin"]),
        "smem": compiled.metadata.shared,
        "chunks": chunks,
        "loop_instructions": len(loop),
        "per_weight": len(loop) / weights_per_thread,
    }


def compile_route_chunked_sm90(chunk: int, experts: int = 128, topk: int = 8) -> dict:
    """Compile the chunked routing's two launches (kernels/route_chunked.py) for chunks of chunk pairs over
    experts experts for sm_90 with Triton's ptxas, no GPU needed: per kernel its registers per thread,
    shared memory, local memory (spills) and whether the histogram and the sort's shuffles lowered."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quads_megatron.kernels import route_chunked as rc

    nb = rc.key_bins(experts)
    cb = rc.count_rows_per_step(rc.CHUNK_TARGET, nb)  # the chunk count the launch aims for
    kernels = {
        "counts": (rc._chunk_counts_kernel, dict(CHUNK=chunk, NB=nb, HISTOGRAM=True, PDL=True)),
        "place": (rc._chunk_place_kernel, dict(TOPK=topk, CHUNK=chunk, NB=nb, CB=cb, PDL=True)),
    }
    types = {"ids_ptr": "*i64", "order_ptr": "*i64", "pos_ptr": "*i64", "tokens_ptr": "*i64", "valid_ptr": "*i8"}
    out = {}
    for name, (fn, consts) in kernels.items():
        params = list(inspect.signature(fn.fn).parameters)
        sig = {p: "constexpr" if p in consts else types.get(p, "*i32") if p.endswith("_ptr") else "i32" for p in params}
        compiled = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=consts),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=rc.chunk_warps(chunk)),
        )
        sass = disassemble(compiled.asm["cubin"])
        out[name] = {
            "regs": registers_per_thread(compiled.asm["cubin"]),
            "smem": compiled.metadata.shared,
            "spills": len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\s", sass)),
            "shuffles": len(re.findall(r"\bSHFL\.", sass)),
            "shared_atomics": len(re.findall(r"\bATOMS\.", sass)),
        }
    return out


def compile_act_quant_sm90(k: int, warps: int, split_k: int = 0, rac: str = "none", gated: bool = True) -> dict:
    """Compile the activation quantization's operand kernel (kernels/act_quant.py) as the block runs it (the
    decoded fp16 operand in the "wgmma" order, one bf16 row of K per program; gated: SiLU(gate) * up of a [M, 2K]
    input, fc2's; split_k: the row as two pieces, act_quant.row_split; rac: "none", "static" (a plan's residual)
    or "dynamic" (per-token selection)) for sm_90 with Triton's ptxas, no GPU needed: registers per thread,
    local memory (spills), instructions (the whole kernel: one row), correctly rounded reciprocals and
    divisions (MUFU.RCP) and the commonest opcodes."""
    import collections
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quads_megatron.kernels import act_quant

    if rac not in ("none", "static", "dynamic"):
        raise ValueError(f"rac must be none, static or dynamic, got {rac!r}")
    fn = act_quant._act_quant_kernel
    params = list(inspect.signature(fn.fn).parameters)
    consts = dict(
        K=k, STATIC=False, HAS_RES=rac != "none", DYNAMIC=rac == "dynamic", OPERAND=True, WGMMA_ORDER=True, GATED=gated,
        HAS_VALID=True, X_BF16=True, FOUR_OVER_SIX=False, FOS_MSE=False, E4M3_MAX=448.0, BLOCK_M=1,
        BLOCK_K=triton.next_power_of_2(k), SPLIT_K=split_k, HAS_TM=False, TM_BM=1, TM_BLOCK_E=2, TM_BLOCK_P=64,
        HAS_ROUTE=False, R_TOPK=1, R_BLOCK=16, R_NB=2, R_HISTOGRAM=True, PDL=True,
    )  # fmt: skip
    types = {
        "x_ptr": "*bf16",
        "op_ptr": "*fp16",
        "sdec_ptr": "*fp32",
        "amax_ptr": "*fp32",
        "valid_ptr": "*i8",
        "mask_ptr": "*i8",
    }
    sig = {p: "constexpr" if p in consts else types.get(p, "*i32") if p.endswith("_ptr") else "i32" for p in params}
    # pointers and the row stride divisible by 16, as Triton's JIT specializes them at the block's shapes
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params if p.endswith("_ptr") or p == "stride_xm"}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, enable_fp_fusion=False),
    )
    ops = collections.Counter()
    for kind, text in _program(disassemble(compiled.asm["cubin"])):
        words = [w for w in _GUARD.sub("", text).split() if re.match(r"^[A-Z][A-Z0-9]*(\.|$)", w)]
        if kind == "ins" and words:
            ops[words[0]] += 1
    base = collections.Counter()
    for op, n in ops.items():
        base[op.split(".")[0]] += n
    return {
        "regs": registers_per_thread(compiled.asm["cubin"]),
        "spills": base["STL"] + base["LDL"],
        "instructions": sum(ops.values()),
        "reciprocals": ops["MUFU.RCP"],
        "ops": dict(base.most_common(8)),
    }


def main(argv: list[str] | None = None) -> None:
    """Compile each tile of a JSON list of WgmmaConfig fields (argv[0]; --k K; --mma: MmaConfig fields, the
    decode-size GEMM; --tiled: on tiled weights) and print the reports as one JSON list; --route-chunked
    CHUNKS: the chunked routing's reports by chunk size instead; --act-quant JSON: the activation quantization's
    (a list of compile_act_quant_sm90's keyword arguments)."""
    from quads_megatron.kernels.tile_configs import MmaConfig, WgmmaConfig

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--route-chunked"]:  # chunk sizes, comma-separated: the chunked routing's reports
        print(json.dumps({c: compile_route_chunked_sm90(int(c)) for c in argv[1].split(",")}))
        return
    if argv[:1] == ["--act-quant"]:  # a JSON list of compile_act_quant_sm90's keyword arguments
        print(json.dumps([compile_act_quant_sm90(**kw) for kw in json.loads(argv[1])]))
        return
    k, mma, tiled = 2048, False, False
    while argv[:1] in (["--k"], ["--mma"], ["--tiled"]):
        if argv[0] == "--mma":
            mma, argv = True, argv[1:]
        elif argv[0] == "--tiled":
            tiled, argv = True, argv[1:]
        else:
            k, argv = int(argv[1]), argv[2:]
    if mma:
        print(json.dumps([compile_mma_sm90(MmaConfig(**t), k, tiled=tiled) for t in json.loads(argv[0])]))
        return
    tiles = [WgmmaConfig(**t) for t in json.loads(argv[0])]
    print(json.dumps([compile_wgmma_sm90(t, k, tiled=tiled) for t in tiles]))


if __name__ == "__main__":
    main()
