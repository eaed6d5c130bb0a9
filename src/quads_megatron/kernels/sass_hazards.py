"""Static check of compiled sm_90 code: is any register an in-flight wgmma reads or writes rewritten
before the wgmma is retired?

wgmma (SASS ``HGMMA``) reads its register A operand and updates its accumulators asynchronously; only
a later ``WARPGROUP.DEPBAR.LE gsb0, N`` (PTX wgmma.wait_group N) makes them safe to touch. ptxas keeps
those registers alive across straight-line code, but across a loop's back edge (wgmma in one iteration,
its wait in the next) it was seen to reuse them (corrupted tiles on the H200, Triton 3.6). This walks
every path from each HGMMA to the wait that retires its group and reports any other instruction that
writes one of its registers. The Gluon GEMM runs it on each kernel it compiles (w4a4_wgmma) and the CPU
tests on the tiles it ships.

disassemble reads a whole cubin: Triton's own SASS dump (``asm["sass"]``) stops at the first instruction
past 64 KB of code (its parser expects 4-digit offsets), which left a large kernel's later partitions
unchecked.
"""

from __future__ import annotations

import os
import re
import subprocess
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
