"""What the converter may delete, and who may write an output: owner markers, protected paths, a lock.

Every directory the converter creates (``<dst>.partial``, and ``<dst>`` once published) holds an
owner marker, MARKER: JSON with the producer, a random id and, once published, the names of the
files written. A directory is removed only when it carries that marker, holds nothing else, and is
neither a source, a parent of a source, the working directory, ``/`` nor the home directory (all
compared after realpath, so symlinks count). One conversion at a time writes an output: OutputLock
is ``<dst>.lock`` (fcntl.flock, with pid, host and start time inside for the refusal message).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import uuid

from quads_megatron import __version__
from quads_megatron.errors import ConvertError

MARKER = ".quads_convert_owner.json"
PRODUCER = "quads_megatron convert"


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z")


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory path durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: str, data: dict) -> None:
    """Write JSON under a temporary name, fsync it, rename it over path, fsync the directory."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def new_marker() -> dict:
    return {"producer": PRODUCER, "version": __version__, "id": uuid.uuid4().hex, "created": now()}


def read_marker(directory: str) -> dict | None:
    """The owner marker of directory, or None when it has none (or an unreadable or foreign one)."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("producer") != PRODUCER:
        return None
    ident = marker.get("id")
    if not isinstance(ident, str) or len(ident) != 32 or any(c not in "0123456789abcdef" for c in ident):
        return None
    return marker


def protected_reason(path: str, sources: list[str]) -> str | None:
    """Why path must never be removed (it is or contains a source, '.', '/' or home), else None."""
    real = os.path.realpath(path)
    inside = lambda p: p == real or p.startswith(real.rstrip(os.sep) + os.sep)  # p is real or below it
    if real == os.sep:
        return "it is the root directory"
    specials = {"the working directory": os.getcwd(), "your home directory": os.path.expanduser("~")}
    for what, p in specials.items():
        if inside(os.path.realpath(p)):
            return f"it is {what}" if os.path.realpath(p) == real else f"it contains {what}"
    for s in sources:
        rs = os.path.realpath(s)
        if inside(rs):
            return f"it is the source {s}" if rs == real else f"it contains the source {s}"
    return None


def check_removable(path: str, sources: list[str], published: bool) -> dict:
    """Refuse (ConvertError naming path) unless path is a directory this converter wrote, holding
    only what it wrote (published outputs list their files in the marker). Returns the marker."""
    reason = protected_reason(path, sources)
    if reason is not None:
        raise ConvertError(f"{path}: refusing to remove it: {reason}")
    if os.path.islink(path) or not os.path.isdir(path):
        raise ConvertError(f"{path}: refusing to remove it: not a directory written by quads convert")
    marker = read_marker(path)
    if marker is None:
        raise ConvertError(
            f"{path}: refusing to remove it: it was not written by quads convert (no valid {MARKER}); "
            "move it away or choose another destination"
        )
    if published:
        files = marker.get("files")
        extra = sorted(set(os.listdir(path)) - set(files or []) - {MARKER}) if isinstance(files, list) else ["?"]
        if extra:
            raise ConvertError(
                f"{path}: refusing to remove it: it holds files quads convert did not write ({extra[:3]}); "
                "move them away or choose another destination"
            )
    return marker


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """Exclusive lock ``<dst>.lock`` for one output: flock on the file (released by the kernel when
    the holder dies), pid/host/start time inside. A lock file left by a process of this host that
    is gone is taken over with a message; one from another host is refused (its pid cannot be
    checked from here)."""

    def __init__(self, dst: str) -> None:
        self.path = dst + ".lock"
        self.dst = dst
        self.fd: int | None = None
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "started": now(), "id": uuid.uuid4().hex}

    def _holder(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _refuse(self, holder: dict, other_host: bool) -> ConvertError:
        who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (started {holder.get('started', '?')})"
        if other_host:
            return ConvertError(
                f"{self.dst} is locked by {who}, which cannot be checked from this host; lock file {self.path}. "
                "Wait for that run to finish, or remove the lock file if it is gone"
            )
        return ConvertError(f"{self.dst} is being written by {who}; lock file {self.path}. Wait for that run to finish")

    def acquire(self) -> None:
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise self._refuse(self._holder(), other_host=False) from None
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the file was removed (released) between open and flock: lock the new one
                os.close(fd)
                continue
            holder = self._holder()
            if holder.get("pid") is not None:
                if holder.get("host") != self.info["host"]:
                    os.close(fd)
                    raise self._refuse(holder, other_host=True)
                pid = holder["pid"]
                gone = not isinstance(pid, int) or not _pid_alive(pid)
                sys.stderr.write(
                    f"quads convert: taking over the stale lock {self.path} of pid {pid} "
                    f"(started {holder.get('started', '?')}), which "
                    f"{'is no longer running' if gone else 'no longer holds it'}\n"
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self.info).encode(), 0)
            os.fsync(fd)
            self.fd = fd
            return
        raise ConvertError(f"{self.path}: could not take the lock (it keeps being replaced)")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if self._holder().get("id") == self.info["id"]:
                os.unlink(self.path)
        finally:
            os.close(self.fd)  # closing drops the flock
            self.fd = None
