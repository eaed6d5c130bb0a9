"""The tile probes' --write-config: the winning tile of each rule of a kernel's data file
(src/quads_megatron/kernels/configs/<kind>.json) written under this GPU's name.

A probe records each timed run as (rule index, probe point, tile, us): the rule its point falls in
(tile_configs.match_rule on the probe's facts), the point (e.g. its row count), the tile's fields. Per
rule, the winner is the tile with the least total time over that rule's points, among the tiles timed at
all of them; rules no point fell in keep their tile, except a max_k copy of a swept rule (fc2's rules copy
fc1's) that still holds the swept rule's old tile: it follows the winner until its own sweep (--gemm
fc2). The device's entry is created from the default device's where the file has none; the whole table
is checked (tile_configs.check_table) before it replaces the file (a temporary file renamed over it: the
file is complete or untouched), one rule per line as the shipped files are (dumps_table).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile

import torch

from quads_megatron.kernels import tile_configs

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "quads_megatron", "kernels", "configs")


def current_first(current, candidates: list) -> list:
    """The rule's current tile first, then the other candidates: a sweep cut short by its time budget has
    timed the current tile at every point, so the writer keeps it unless a candidate timed there beats it."""
    return [current] + [c for c in candidates if c != current]


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


def same_rule_but_k(rule: dict, other: dict) -> bool:
    """Whether rule is a max_k copy of other: the same conditions but for its max_k (fc2's rules copy fc1's)."""
    def conditions(r: dict) -> dict:
        return {k: v for k, v in r.items() if k not in ("tile", "max_k")}

    return "max_k" in rule and "max_k" not in other and conditions(rule) == conditions(other)


def apply_winners(entry: dict, kind: str, key: str, runs: list[tuple[int, object, dict, float]]) -> list[str]:
    """Set each swept rule's tile to its winner in entry (a device's {"rules": [...]}); a max_k copy of a swept
    rule that still holds the tile the swept rule had, and was not swept itself, follows it (an fc1 sweep
    keeps fc2 on fc1's tiles until fc2 is swept with --gemm fc2). Returns one line per change."""
    rules, won = entry["rules"], winners(runs)
    before = {i: copy.deepcopy(rules[i].get("tile")) for i in won}
    changes = []
    for i, tile in won.items():
        changes.append(f"{kind} {key} rule {i} {rules[i].get('tile')} -> {tile}")
        rules[i]["tile"] = tile
    for i, tile in won.items():
        for j, rule in enumerate(rules):
            if j not in won and same_rule_but_k(rule, rules[i]) and rule["tile"] == before[i]:
                changes.append(f"{kind} {key} rule {j} (max_k copy of rule {i}) -> {tile}")
                rule["tile"] = copy.deepcopy(tile)
    return changes


def dumps_table(obj, depth: int = 0, rules: bool = False) -> str:
    """A data file's text: JSON indented by two, each rule of a "rules" list on one line (a rule reads as one
    row, and a sweep's diff names only the rules it changed)."""
    pad = "  " * depth
    if isinstance(obj, dict) and obj:
        items = [f"{pad}  {json.dumps(k)}: {dumps_table(v, depth + 1, k == 'rules')}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and rules and obj:
        return "[\n" + ",\n".join(f"{pad}  {json.dumps(e)}" for e in obj) + "\n" + pad + "]"
    return json.dumps(obj)


def write_config(kind: str, runs: list[tuple[int, object, dict, float]], device: str = "cuda") -> str:
    """Write the winners of runs into kind's data file under device's name; returns the file's path."""
    path = os.path.normpath(os.path.join(CONFIGS, f"{kind}.json"))
    with open(path) as f:
        table = json.load(f)
    key = tile_configs.device_key(torch.device(device))
    entry = table["devices"].get(key) or copy.deepcopy(table["devices"][table["default_device"]])
    changes = apply_winners(entry, kind, key, runs)
    table["devices"][key] = entry
    tile_configs.check_table(kind, table, path)  # before anything is written
    print("\n".join(changes), flush=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps_table(table) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
