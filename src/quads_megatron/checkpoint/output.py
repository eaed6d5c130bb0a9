"""The converter's output directory: fingerprints, resumable state, progress, side files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time

from quads_megatron.checkpoint.modelopt import INDEX

STATE = "quads_convert_state.json"


def source_fingerprint(src: str, shards: dict[str, list[str]]) -> str:
    h = hashlib.sha256()
    for shard in sorted(shards):
        st = os.stat(os.path.join(src, shard))
        h.update(f"{shard}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def dir_fingerprint(path: str) -> str:
    """Names, sizes and mtimes of the files in a checkpoint directory."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        st = os.stat(os.path.join(path, name))
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.time()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            fill = int(width * self.done / max(self.total, 1))
            sys.stderr.write(
                f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {label[-40:]:<40} "
                f"{time.time() - self.t0:6.1f}s"
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def load_state(partial: str, fingerprint: dict) -> dict:
    path = os.path.join(partial, STATE)
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
        if state.get("fingerprint") == fingerprint:
            return state  # resume
        shutil.rmtree(partial)  # a leftover of another source or other options: start over
    elif os.path.exists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)
    state = {"fingerprint": fingerprint}
    save_state(partial, state)
    return state


def save_state(partial: str, state: dict) -> None:
    tmp = os.path.join(partial, STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, os.path.join(partial, STATE))


def copy_side_files(src: str, dst: str) -> None:
    for name in os.listdir(src):
        if name.endswith(".safetensors") or name in (INDEX, "config.json", "hf_quant_config.json"):
            continue
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst, name))
