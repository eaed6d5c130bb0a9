"""Run an existing training script with QUADS patches applied first.

QUADS_CONFIG=quads.yaml torchrun --nproc-per-node 8 -m quads_megatron.launch train.py --train-args ...
python -m quads_megatron.launch --quads-config quads.yaml train.py --train-args ...

The script runs as ``python train.py ...`` would run it: as ``__main__``, with ``__file__`` its
absolute path, ``sys.argv`` = [train.py as given, its arguments], and the script's directory
(symlinks resolved) first on sys.path in place of the launcher's, so its sibling modules import.
Frameworks that build the model in other processes (Ray workers) use the QUADS_CONFIG startup
hook instead (quads_megatron._startup).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

USAGE = "usage: python -m quads_megatron.launch [--quads-config FILE] SCRIPT [ARGS...]"


def _parse(args: list[str]) -> tuple[str | None, list[str]]:
    config = None
    if args[:1] == ["--quads-config"]:
        if len(args) < 2:
            raise SystemExit(f"quads_megatron.launch: --quads-config needs a path\n{USAGE}")
        config, args = args[1], args[2:]
    elif args[:1] and args[0].startswith("--quads-config="):
        config, args = args[0].split("=", 1)[1], args[1:]
    if not args:
        raise SystemExit(USAGE)
    if not os.path.isfile(args[0]):
        raise SystemExit(f"quads_megatron.launch: {args[0]!r} is not a file\n{USAGE}")
    return config, args


def run_script(argv: list[str]) -> None:
    """Execute argv[0] as the __main__ module with sys.argv = argv (as the python command would)."""
    script = argv[0]
    path = os.path.abspath(script)
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec")
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.argv = list(argv)
    script_dir = os.path.dirname(os.path.realpath(path))  # python SCRIPT puts its directory first
    if sys.path:
        sys.path[0] = script_dir  # in place of the launcher's entry (the cwd under -m)
    else:
        sys.path.insert(0, script_dir)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def main(argv: list[str] | None = None) -> None:
    config, args = _parse(list(sys.argv[1:] if argv is None else argv))
    import quads_megatron

    quads_megatron.apply(config)
    run_script(args)


if __name__ == "__main__":
    main()
