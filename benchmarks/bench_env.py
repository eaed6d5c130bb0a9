"""What every device benchmark records with its numbers, and how it writes them.

header(): date, device name / capability / memory / driver, and the versions of torch, triton, SGLang
(with sglang-kernel and flashinfer), transformers, Transformer Engine and quads_megatron. write_json()
replaces a file atomically; table() renders a markdown table; stats() gives median / min / max.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess

PACKAGES = (
    "torch",
    "triton",
    "sglang",
    "sglang-kernel",
    "flashinfer-python",
    "transformers",
    "transformer-engine",
    "quads-megatron",
)


def versions() -> dict[str, str]:
    """Installed version of each package in PACKAGES ('-' where it is not installed)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def device_info() -> dict[str, object]:
    """The CUDA device (name, sm, memory, driver) or {'name': 'cpu'}."""
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu", "cpu_count": os.cpu_count()}
    p = torch.cuda.get_device_properties(0)
    info: dict[str, object] = {
        "name": p.name,
        "sm": f"{p.major}{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "-"
    except (OSError, subprocess.TimeoutExpired):
        info["driver"] = "-"
    return info


def header() -> dict[str, object]:
    return {"date": datetime.date.today().isoformat(), "device": device_info(), "versions": versions()}


def header_lines(h: dict) -> list[str]:
    """The header as markdown lines (date, device, versions)."""
    d = h["device"]
    dev = (
        d["name"] if d["name"] == "cpu" else f"{d['name']} (sm_{d['sm']}, {d['memory_gib']} GiB, driver {d['driver']})"
    )
    v = ", ".join(f"{k} {val}" for k, val in h["versions"].items())
    return [f"Date: {h['date']}. Device: {dev}.", "", f"Versions: {v}."]


def write_json(path: str, obj: object) -> None:
    """Write obj as indented JSON through a temporary file and a rename (never a half-written file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=float)
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def stats(values: list[float]) -> dict[str, float]:
    """Median, min and max of a non-empty list."""
    if not values:
        raise ValueError("stats of an empty list")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(x: object, spec: str = ".1f") -> str:
    """A number for a table cell; '-' for None/NaN/missing."""
    if x is None or not isinstance(x, (int, float)) or x != x:
        return "-"
    return format(x, spec)


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table as lines."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out
