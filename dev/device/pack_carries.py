"""Pack the full GPU stack into staging carries that each fit one device call with the working tree.

A call carries at most 64 MiB, the working tree included, so the carry budget is 64 MiB minus the tree
(tracked and untracked-not-ignored files, measured now) minus a margin. Wheels are never split; Transformer
Engine's core wheel is a byte stream cut into parts (te_core.partNN, in stream order) that fill the space
the wheels leave. The project's wheel lands in the last carry, the one install.sh is given.

    python dev/device/pack_carries.py OUT_DIR --core CORE_WHEEL --item SUB=FILE ... --proj PROJ_WHEEL

writes OUT_DIR/s0 .. OUT_DIR/sN (SUB/FILE inside each, the core parts at the top level) and prints one line
per carry. OUT_DIR must not exist yet (nothing is overwritten or removed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

MIB = 1 << 20
CALL_LIMIT = 64 * MIB
MARGIN = 2 * MIB  # the tree grows between packing and the calls (logs, summaries)


def tree_bytes(root: str) -> int:
    """Bytes of what a device call sends besides its carries: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    paths = [p for p in out.decode().split("\0") if p]
    return sum(os.path.getsize(os.path.join(root, p)) for p in paths if os.path.isfile(os.path.join(root, p)))


def pack(items: list[tuple[str, str, int]], proj: tuple[str, int], core_size: int, budget: int) -> list[dict]:
    """Bins of at most budget bytes: {'files': [(sub, path)], 'core': [(offset, size)], 'free': bytes}.

    items: (sub, path, size) wheels, placed first-fit decreasing; proj: (path, size), in the last bin; the
    core's bytes then fill the bins in order, new bins opened as needed.
    """
    too_big = [p for _, p, s in [*items, ("proj", *proj)] if s > budget]
    if too_big:
        raise SystemExit(f"pack_carries: {too_big[0]} is larger than a carry's budget ({budget / MIB:.1f} MiB)")
    bins: list[dict] = [{"files": [("proj", proj[0])], "core": [], "free": budget - proj[1]}]
    for sub, path, size in sorted(items, key=lambda t: -t[2]):
        b = next((b for b in bins if b["free"] >= size), None)
        if b is None:
            b = {"files": [], "core": [], "free": budget}
            bins.append(b)
        b["files"].append((sub, path))
        b["free"] -= size
    offset = 0
    for b in bins:
        take = min(b["free"], core_size - offset)
        if take > 0:
            b["core"].append((offset, take))
            b["free"] -= take
            offset += take
    while offset < core_size:
        take = min(budget, core_size - offset)
        bins.append({"files": [], "core": [(offset, take)], "free": budget - take})
        offset += take
    return bins[1:] + bins[:1]  # the project's bin last: install.sh installs from it


def write(out: str, bins: list[dict], core: str) -> None:
    os.makedirs(out)
    starts = sorted(off for b in bins for off, _ in b["core"])
    with open(core, "rb") as src:
        for k, b in enumerate(bins):
            d = os.path.join(out, f"s{k}")
            os.makedirs(d)
            for sub, path in b["files"]:
                os.makedirs(os.path.join(d, sub), exist_ok=True)
                os.link(path, os.path.join(d, sub, os.path.basename(path)))
            for off, size in b["core"]:
                src.seek(off)
                with open(os.path.join(d, f"te_core.part{starts.index(off):02d}"), "xb") as dst:
                    dst.write(src.read(size))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--core", required=True, help="Transformer Engine's core wheel (split into parts)")
    p.add_argument("--item", action="append", default=[], metavar="SUB=FILE", help="a wheel, kept whole, in SUB/")
    p.add_argument("--proj", required=True, help="this project's wheel (in the last carry)")
    p.add_argument("--repo", default=".", help="the checkout whose working tree travels with each call")
    a = p.parse_args(argv)
    if os.path.exists(a.out):
        raise SystemExit(f"pack_carries: {a.out} exists; remove it first")
    items = []
    for spec in a.item:
        sub, _, path = spec.partition("=")
        if not sub or not os.path.isfile(path):
            raise SystemExit(f"pack_carries: --item {spec!r}: expected SUB=FILE with an existing file")
        items.append((sub, path, os.path.getsize(path)))
    tree = tree_bytes(a.repo)
    budget = CALL_LIMIT - tree - MARGIN
    bins = pack(items, (a.proj, os.path.getsize(a.proj)), os.path.getsize(a.core), budget)
    write(a.out, bins, a.core)
    print(f"working tree {tree / MIB:.1f} MiB; carry budget {budget / MIB:.1f} MiB; {len(bins)} carries")
    for k, b in enumerate(bins):
        used = budget - b["free"]
        print(f"  s{k}: {used / MIB:5.1f} MiB, {len(b['files'])} wheels, {len(b['core'])} core part(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
