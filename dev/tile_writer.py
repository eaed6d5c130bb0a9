"""The tile probes' --write-config: the winning tile of each rule of a kernel's data file
(src/quads_megatron/kernels/configs/<kind>.json) written under this GPU's name.

A probe records each timed run as (rule index, probe point, tile, us): the rule its point falls in
(tile_configs.match_rule on the probe's facts), the point (e.g. its row count), the tile's fields. Per
rule, the winner is the tile with the least total time over that rule's points, among the tiles timed at
all of them; rules no point fell in keep their tile. The device's entry is created from the default
device's where the file has none; the whole table is checked (tile_configs.check_table) before it
replaces the file (a temporary file renamed over it: the file is complete or untouched).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile

import torch

from quads_megatron.kernels import tile_configs

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "quads_megatron", "kernels", "configs")


def winners(runs: list[tuple[int, object, dict, float]]) -> dict[int, dict]:
    """rule index -> the tile with the least total time over the rule's points (timed at all of them)."""
    out = {}
    for rule in sorted({r[0] for r in runs}):
        mine = [r for r in runs if r[0] == rule]
        points = {r[1] for r in mine}
        totals: dict[str, list] = {}
        for _, point, tile, us in mine:
            key = json.dumps(tile, sort_keys=True)
            totals.setdefault(key, [set(), 0.0])
            totals[key][0].add(point)
            totals[key][1] += us
        full = {key: total for key, (seen, total) in totals.items() if seen == points}
        if full:
            out[rule] = json.loads(min(full, key=full.get))
    return out


def write_config(kind: str, runs: list[tuple[int, object, dict, float]], device: str = "cuda") -> str:
    """Write the winners of runs into kind's data file under device's name; returns the file's path."""
    path = os.path.normpath(os.path.join(CONFIGS, f"{kind}.json"))
    with open(path) as f:
        table = json.load(f)
    key = tile_configs.device_key(torch.device(device))
    entry = table["devices"].get(key) or copy.deepcopy(table["devices"][table["default_device"]])
    changes = []
    for rule, tile in winners(runs).items():
        changes.append(f"{kind} {key} rule {rule} {entry['rules'][rule].get('tile')} -> {tile}")
        entry["rules"][rule]["tile"] = tile
    table["devices"][key] = entry
    tile_configs.check_table(kind, table, path)  # before anything is written
    print("\n".join(changes), flush=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
