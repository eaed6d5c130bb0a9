"""The converter's output directory: checked paths, lock, resumable state, shard records, publish.

ConversionOutput is what both converters (hf.convert_hf, megatron.convert_megatron_dist) write
through. Output goes to ``<dst>.partial`` (owner marker, see ownership.py) with a state file
(fsynced) that records, per finished shard, its tensor names, tensor bytes, file size and sha256;
a resumed run re-checks those and writes again what does not match. Verification is part of
completion: a failed verify marks the partial, and the next run writes every shard again and
verifies before it publishes. Publishing is one rename of the partial onto ``<dst>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import torch
from safetensors.torch import save_file

from quads_megatron.checkpoint.modelopt import INDEX
from quads_megatron.checkpoint.ownership import (
    MARKER,
    OutputLock,
    check_removable,
    fsync_dir,
    new_marker,
    now,
    read_marker,
    write_json_durably,
)
from quads_megatron.errors import ConvertError

STATE = "quads_convert_state.json"
FORMAT = 2  # output layout version (input_scale on every quantized linear, shard records): part of the fingerprint


def say(message: str, enabled: bool = True) -> None:
    if enabled:
        sys.stderr.write(f"quads convert: {message}\n")
        sys.stderr.flush()


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


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads compare equal to themselves, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(as_bytes(a), as_bytes(b))


def file_digest(path: str) -> tuple[int, str]:
    """(size, sha256 hex) of a file, after fsync (so what is recorded is what is on disk)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        while chunk := f.read(8 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


class Progress:
    """Progress of one phase on stderr: a bar on a terminal, otherwise a line for the first and last
    step and at most one every 5 s."""

    def __init__(self, phase: str, total: int, enabled: bool) -> None:
        self.phase, self.total, self.done, self.enabled = phase, total, 0, enabled
        self.t0 = self.last = time.time()
        self.tty = sys.stderr.isatty()

    def step(self, label: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        t = time.time()
        secs = t - self.t0
        if self.tty:
            width = 30
            fill = int(width * self.done / max(self.total, 1))
            sys.stderr.write(
                f"\r{self.phase:<7} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                f"{label[-40:]:<40} {secs:6.1f}s"
            )
            if self.done >= self.total:
                sys.stderr.write("\n")
        elif self.done in (1, self.total) or t - self.last >= 5:
            sys.stderr.write(f"quads convert: {self.phase} {self.done}/{self.total} {label} ({secs:.1f}s)\n")
            self.last = t
        sys.stderr.flush()


def copy_side_files(src: str, dst: str) -> None:
    """Tokenizer, generation config and other plain files of src (not weights, configs or our own)."""
    skip = (INDEX, "config.json", "hf_quant_config.json", MARKER, STATE)
    for name in os.listdir(src):
        if name.endswith((".safetensors", ".tmp")) or name in skip:
            continue
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst, name))


class ConversionOutput:
    """Where a conversion writes; everything is written inside ``with out.writing(fingerprint):``.

    Construction checks the paths and writes nothing: dst must not exist unless overwrite (and then
    be a published output of this converter that holds nothing else), and a leftover ``<dst>.partial``
    must be this converter's; none of them may be, or contain, a source, '.', '/' or home, nor lie
    inside a source.
    """

    def __init__(self, dst: str, sources: list[str], overwrite: bool = False, progress: bool = True) -> None:
        self.dst_arg = dst
        self.dst = os.path.realpath(dst)
        self.partial = self.dst + ".partial"
        self.sources = [s for s in sources if s]
        self.fingerprint: dict = {}
        self.overwrite, self.progress = overwrite, progress
        self.must_verify = False
        self.state: dict = {}
        self.lock: OutputLock | None = None
        self.check_paths()

    def check_paths(self) -> None:
        for src in self.sources:  # the output (and its partial, lock) would land inside a checkpoint read
            real = os.path.realpath(src)
            if self.dst.startswith(real.rstrip(os.sep) + os.sep):
                raise ConvertError(f"{self.dst_arg}: refusing to write inside the source {src}; choose another output")
        if os.path.lexists(self.dst):
            if not self.overwrite:
                raise ConvertError(f"{self.dst_arg} exists; pass --overwrite (overwrite=True) to replace it")
            check_removable(self.dst, self.sources, published=True)
        if os.path.lexists(self.partial):
            check_removable(self.partial, self.sources, published=False)

    @contextlib.contextmanager
    def writing(self, fingerprint: dict) -> Iterator[ConversionOutput]:
        """Hold the output's lock; reuse the partial of an earlier run with the same fingerprint
        (sources, options, layout) or start a new one."""
        self.fingerprint = {**fingerprint, "format": FORMAT}
        os.makedirs(os.path.dirname(self.dst), exist_ok=True)
        self.lock = OutputLock(self.dst)
        self.lock.acquire()
        try:
            self.check_paths()  # again, now that no other conversion can change them
            self._open_partial()
            yield self
        finally:
            self.lock.release()

    # ------------------------------------------------------------------ state

    def save_state(self) -> None:
        write_json_durably(os.path.join(self.partial, STATE), self.state)

    def _open_partial(self) -> None:
        state = None
        if os.path.exists(self.partial):
            marker = read_marker(self.partial) or {}
            try:
                with open(os.path.join(self.partial, STATE)) as f:
                    state = json.load(f)
            except (OSError, ValueError):
                state = None
            if not (
                isinstance(state, dict)
                and state.get("fingerprint") == self.fingerprint
                and state.get("owner") == marker.get("id")
                and isinstance(state.get("done"), dict)
            ):
                say(f"removing {self.partial}, left by a run with other sources or options")
                shutil.rmtree(self.partial)
                state = None
        if state is None:
            os.makedirs(self.partial)
            marker = new_marker()
            write_json_durably(os.path.join(self.partial, MARKER), marker)
            state = {"fingerprint": self.fingerprint, "owner": marker["id"], "done": {}}
            self.state = state
            self.save_state()
        self.state = state
        if state.get("verify") == "failed":
            say("the previous run's verification failed: writing every shard again, then verifying")
            state["done"] = {}
            state.pop("verify")
            self.must_verify = True
            self.save_state()

    def resume(self, shards: list[str]) -> None:
        """Re-check the recorded size and sha256 of the finished shards among ``shards``; forget the
        ones that do not match (they are written again) and say how many are done."""
        done = self.state["done"]
        finished = [s for s in shards if s in done]
        if not finished:
            return
        progress = Progress("check", len(finished), self.progress)
        for shard in finished:
            path = os.path.join(self.partial, shard)
            rec = done[shard]
            try:
                ok = os.path.getsize(path) == rec["size"] and file_digest(path)[1] == rec["sha256"]
            except (OSError, KeyError, TypeError):
                ok = False
            if not ok:
                say(f"{path} does not match its recorded size and sha256: writing it again")
                del done[shard]
            progress.step(shard)
        self.save_state()
        n = sum(s in done for s in shards)
        if n:
            say(f"resuming: {n} of {len(shards)} shards already done", self.progress)

    def done_keys(self, shard: str) -> list[str] | None:
        rec = self.state["done"].get(shard)
        return None if rec is None else list(rec["keys"])

    def write_shard(self, shard: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write one shard (under a temporary name, fsynced, then renamed) and record it."""
        path = os.path.join(self.partial, shard)
        tmp = path + ".tmp"
        save_file(tensors, tmp, metadata={"format": "pt"})
        size, sha = file_digest(tmp)
        os.replace(tmp, path)
        fsync_dir(self.partial)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.state["done"][shard] = {"keys": sorted(tensors), "nbytes": nbytes, "size": size, "sha256": sha}
        self.save_state()

    def write_index(self, weight_map: dict[str, str]) -> None:
        """The safetensors index; metadata.total_size counts every shard's tensor bytes."""
        total = sum(self.state["done"][s]["nbytes"] for s in set(weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json_durably(os.path.join(self.partial, INDEX), index)

    def verify(self, check: Callable[[], object], requested: bool) -> None:
        """Run check (raises ConvertError on a mismatch) when requested or when the previous run's
        verification failed; record the result, so a failed partial is never published as is."""
        if not (requested or self.must_verify):
            return
        try:
            check()
        except ConvertError as e:
            self.state["verify"] = "failed"
            self.save_state()
            raise ConvertError(
                f"{e} (the partial output {self.partial} is kept, marked unverified: the next run writes it "
                "again and verifies it)"
            ) from e
        self.state["verify"] = "passed"
        self.save_state()

    def publish(self) -> None:
        """Rename the partial onto dst (an existing dst, checked again, is moved aside and removed)."""
        if os.path.lexists(self.dst):
            if not self.overwrite:
                raise ConvertError(f"{self.dst_arg} appeared while converting; pass --overwrite to replace it")
            check_removable(self.dst, self.sources, published=True)
        for name in os.listdir(self.partial):
            if name.endswith(".tmp") or name == STATE:
                os.remove(os.path.join(self.partial, name))
        for name in os.listdir(self.partial):  # configs and side files too: durable before the rename
            with open(os.path.join(self.partial, name), "rb") as f:
                os.fsync(f.fileno())
        marker = read_marker(self.partial) or new_marker()
        marker["files"] = sorted(set(os.listdir(self.partial)) - {MARKER})
        marker["published"] = now()
        write_json_durably(os.path.join(self.partial, MARKER), marker)
        aside = None
        if os.path.lexists(self.dst):
            aside = f"{self.dst}.replaced-{uuid.uuid4().hex[:8]}"
            os.rename(self.dst, aside)
        os.rename(self.partial, self.dst)
        fsync_dir(os.path.dirname(self.dst))
        if aside is not None:
            shutil.rmtree(aside)
