"""Run an existing training script with QUADS patches applied first.

QUADS_CONFIG=quads.yaml torchrun --nproc-per-node 8 -m quads_megatron.launch train.py --train-args ...
python -m quads_megatron.launch --quads-config quads.yaml train.py --train-args ...
"""

from __future__ import annotations

import runpy
import sys

import quads_megatron


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    config = None
    if args[:1] == ["--quads-config"]:
        if len(args) < 2:
            raise SystemExit("--quads-config needs a path")
        config, args = args[1], args[2:]
    if not args:
        raise SystemExit("usage: python -m quads_megatron.launch [--quads-config FILE] SCRIPT [ARGS...]")
    quads_megatron.apply(config)
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
