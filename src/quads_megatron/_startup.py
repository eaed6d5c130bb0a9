"""Startup hook: apply QUADS in every Python process started with QUADS_CONFIG set.

The wheel ships ``quads_megatron_startup.pth`` at the site-packages root; Python runs its one line at
interpreter start, and that line imports this module and calls activate() only when QUADS_CONFIG is
set (otherwise nothing of quads_megatron is imported). This is the route for frameworks that build
the model in worker processes that never run ``quads_megatron.launch`` (slime, verl: Ray actors):
put QUADS_CONFIG (an absolute path) in the workers' environment.

activate() imports nothing heavy: it watches for ``megatron.core.transformer.moe.moe_layer``. When
that module has loaded, MoELayer.__init__ is wrapped so that the first MoE layer built runs
``quads_megatron.apply()`` (all of megatron-core is importable by then) before it is constructed,
so every MoE layer of the process is tagged. A process that never imports megatron's MoE layer
(an SGLang server, a data loader) is left alone. Failures at interpreter start print one line on
stderr and let the process run; a config or version the trainer cannot use raises from the first
MoE layer's construction (a trainer that asked for QUADS must not train without it).

At interpreter start only the standard library is imported; torch and the patches are imported once
megatron's MoE layer module has loaded.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

ENV = "QUADS_CONFIG"
TARGET = "megatron.core.transformer.moe.moe_layer"
PTH_NAME = "quads_megatron_startup.pth"
#: the one line of the .pth file (site.py executes lines that start with "import"): with QUADS_CONFIG
#: set, import this module and activate(); a failed import prints one line instead of site's traceback.
#: site.py runs a venv's .pth lines twice on CPython 3.11: a mark in site's globals keeps it to once.
PTH_LINE = (
    "import os, sys; exec(\"if not globals().get('_quads_startup_seen'):\\n"
    " globals()['_quads_startup_seen'] = True\\n"
    " try:\\n  import quads_megatron._startup as _q\\n except Exception as _e:\\n"
    "  print(f'quads_megatron: QUADS_CONFIG startup hook not loaded: {type(_e).__name__}: {_e}', file=sys.stderr)"
    '\\n else:\\n  _q.activate()") if os.environ.get("QUADS_CONFIG") else None\n'
)

_STATE: dict[str, Any] = {"activated": False, "finder": None, "cls": None, "orig": None, "wrapper": None}


def _say(msg: str) -> None:
    print(f"quads_megatron: {msg}", file=sys.stderr, flush=True)


def activate() -> bool:
    """Arm the hook when QUADS_CONFIG is set (called by the .pth line); never raises. Idempotent:
    site.py may run a venv's .pth files twice (CPython 3.11 does)."""
    try:
        path = os.environ.get(ENV)
        if not path or _STATE["activated"]:
            return bool(path)
        _STATE["activated"] = True
        if not os.path.isfile(path):
            _say(f"{ENV}={path!r} is not a file (cwd {os.getcwd()}); MoE layers built here will refuse to build")
        module = sys.modules.get(TARGET)
        if module is not None:
            _install(module)
        elif _STATE["finder"] is None:
            _STATE["finder"] = _MoELayerFinder()
            sys.meta_path.insert(0, _STATE["finder"])
        return True
    except Exception as e:  # a broken hook must not take down an unrelated process
        _say(f"{ENV} startup hook failed, QUADS not armed in this process: {type(e).__name__}: {e}")
        return False


def is_armed() -> bool:
    """True while the hook waits for megatron's MoE layer module or its first MoE layer."""
    return _STATE["finder"] is not None or _STATE["wrapper"] is not None


def disarm() -> None:
    """Undo activate(): drop the import watcher and the deferred MoELayer.__init__ (apply() calls this)."""
    finder = _STATE["finder"]
    if finder is not None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        _STATE["finder"] = None
    cls, wrapper = _STATE["cls"], _STATE["wrapper"]
    if cls is not None and cls.__dict__.get("__init__") is wrapper:
        cls.__init__ = _STATE["orig"]
    _STATE.update(cls=None, orig=None, wrapper=None)


class _MoELayerFinder(importlib.abc.MetaPathFinder):
    """Finds megatron's MoE layer module with the other finders and runs _install after it loads."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterExecLoader(spec.loader)
                return spec
        return None


class _AfterExecLoader(importlib.abc.Loader):
    """Delegates to the real loader, then installs the deferred apply on the loaded module."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        finder = _STATE["finder"]
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)
        _STATE["finder"] = None
        _install(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._inner, name)


def _install(module: Any) -> None:
    """Wrap MoELayer.__init__: the first MoE layer built applies QUADS, then is built (and tagged)."""
    cls = getattr(module, "MoELayer", None)
    if cls is None or _STATE["wrapper"] is not None:
        return
    from quads_megatron.integrations.megatron import qat  # stdlib-only until apply() runs below

    if qat.is_applied():  # quads_megatron.apply() already ran in this process
        return
    orig = cls.__dict__["__init__"]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        import quads_megatron
        from quads_megatron.errors import QuadsError

        try:
            quads_megatron.apply()  # reads QUADS_CONFIG; disarms this wrapper just before patching
        except QuadsError as e:  # stays armed: every MoE layer of this process refuses to build
            raise type(e)(f"{ENV}={os.environ.get(ENV)!r} (startup hook): {e}") from e
        cls.__init__(self, *args, **kwargs)  # the patched __init__: builds, then tags

    __init__.__wrapped__ = orig  # type: ignore[attr-defined]
    _STATE.update(cls=cls, orig=orig, wrapper=__init__)
    cls.__init__ = __init__
