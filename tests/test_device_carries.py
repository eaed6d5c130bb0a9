"""dev/device/pack_carries.py: the full GPU stack packed into carries that each fit one device call beside
the working tree (wheels whole, the TE core cut in stream order, the project in the last carry)."""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pack_carries():
    spec = importlib.util.spec_from_file_location("pack_carries", ROOT / "dev" / "device" / "pack_carries.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_carries_fit_keep_wheels_whole_and_the_core_in_order(tmp_path):
    pc = _pack_carries()
    core = tmp_path / "core.whl"
    core.write_bytes(os.urandom(1000))
    wheels = []
    for name, size in (("a1.whl", 300), ("a2.whl", 250), ("b1.whl", 120), ("te1.whl", 40)):
        (tmp_path / name).write_bytes(os.urandom(size))
        wheels.append((name[0] if name[0] != "t" else "te", str(tmp_path / name), size))
    proj = tmp_path / "proj.whl"
    proj.write_bytes(os.urandom(60))
    budget = 400
    bins = pc.pack(wheels, (str(proj), 60), 1000, budget)
    out = tmp_path / "carry"
    pc.write(str(out), bins, str(core))
    dirs = sorted(out.iterdir(), key=lambda p: int(p.name[1:]))
    sizes = [sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in dirs]
    assert max(sizes) <= budget and sum(sizes) == 1000 + 300 + 250 + 120 + 40 + 60
    assert (dirs[-1] / "proj" / "proj.whl").read_bytes() == proj.read_bytes()  # the install carry
    parts = sorted(f for d in dirs for f in d.glob("te_core.part*"))
    assert b"".join(p.read_bytes() for p in sorted(parts, key=lambda p: p.name)) == core.read_bytes()
    for name in ("a1.whl", "a2.whl", "b1.whl", "te1.whl"):
        sub = "te" if name.startswith("te") else name[0]
        (found,) = [d / sub / name for d in dirs if (d / sub / name).exists()]
        assert found.read_bytes() == (tmp_path / name).read_bytes()
    with pytest.raises(SystemExit, match="larger than a carry's budget"):
        pc.pack([("a", "big.whl", 500)], (str(proj), 60), 1000, budget)
