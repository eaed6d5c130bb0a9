"""The SGLang versions quads_nvfp4 supports, checked without importing SGLang (a parent process that only
decides whether it can start an engine elsewhere should not pay SGLang's import or touch the GPU)."""

from __future__ import annotations

import os
import re

from quads_megatron.errors import QuadsSglangError

#: SGLang versions this adapter supports, [0.5.17, 0.5.24): the CPU tests run 0.5.23 (the real package, a
#: real Qwen3-MoE model); 0.5.17 is the newest SGLang for torch 2.11, the GPU engine's version on the H200.
#: The adapter follows both versions' sources (compat.py); versions in between were not run, newer ones are
#: refused because SGLang changes its MoE interfaces between patch releases (0.5.17 -> 0.5.23 did).
SUPPORTED_RANGE = ((0, 5, 17), (0, 5, 24))
TESTED = "0.5.23 (CPU tests) and 0.5.17 (GPU engine)"
ALLOW_UNTESTED_ENV = "QUADS_ALLOW_UNTESTED_SGLANG"


def version_tuple(v: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string; local and pre-release tails are ignored."""
    return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:3])


def installed_version() -> str:
    """The installed SGLang's version from its package metadata (SGLang itself is not imported)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:  # a source tree on sys.path without metadata
        import sglang

        return sglang.__version__


def check_version(version: str | None = None) -> str:
    """The SGLang version (default: the installed one), or QuadsSglangError when outside SUPPORTED_RANGE."""
    version = installed_version() if version is None else version
    lo, hi = SUPPORTED_RANGE
    if not lo <= version_tuple(version) < hi and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise QuadsSglangError(
            f"quads_nvfp4 supports sglang >= {'.'.join(map(str, lo))}, < {'.'.join(map(str, hi))} (tested: "
            f"{TESTED}); found {version}. Set {ALLOW_UNTESTED_ENV}=1 to try it anyway."
        )
    return version
