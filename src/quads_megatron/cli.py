"""`quads` command line: convert checkpoints to NVFP4, run the CPU RL demo."""

from __future__ import annotations

import argparse
import json
import sys


def _convert(args: argparse.Namespace) -> int:
    from safetensors.torch import load_file

    from quads_megatron.checkpoint import (
        ConvertError,
        ConvertOptions,
        convert_hf,
        convert_megatron_dist,
        quads_extras,
        verify_conversion,
    )

    input_amax: dict[str, float] = {}
    if args.input_amax:
        if args.input_amax.endswith(".json"):
            with open(args.input_amax) as f:
                input_amax = {k: float(v) for k, v in json.load(f).items()}
        else:
            input_amax = {k: float(v.float().max()) for k, v in load_file(args.input_amax).items()}
    try:
        quads = {}
        if args.quads_config or args.rac_plans:
            from quads_megatron.config import load_config

            rollout = load_config(args.quads_config).to_dict()["rollout"] if args.quads_config else None
            quads = quads_extras(rollout, args.rac_plans)
    except (ConvertError, ValueError) as e:
        print(f"quads convert: error: {e}", file=sys.stderr)
        return 2
    opts = ConvertOptions(
        quads=quads,
        include_shared_experts=args.include_shared_experts,
        exclude=tuple(args.exclude),
        input_amax=input_amax,
        overwrite=args.overwrite,
        verify=args.verify,
        progress=not args.quiet,
    )
    try:
        if args.verify_only:
            n = verify_conversion(args.src, args.dst, opts)
            print(f"verified {n} tensors of {args.dst} against {args.src}")
            return 0
        if args.megatron_base_hf:
            summary = convert_megatron_dist(
                args.src, args.dst, args.megatron_base_hf, opts, non_expert=args.non_expert_from
            )
            print(
                f"converted {summary['quantized_modules']} expert linears of {summary['layers']} layers -> {args.dst}"
            )
            return 0
        summary = convert_hf(args.src, args.dst, opts)
    except ConvertError as e:
        print(f"quads convert: error: {e}", file=sys.stderr)
        return 2
    mb = summary["bytes_in_this_run"] / 1e6
    secs = max(float(summary["seconds"]), 1e-9)
    print(
        f"converted {summary['quantized_modules']} expert linears in {summary['shards']} shards "
        f"-> {args.dst} ({mb:.1f} MB read, {mb / secs:.1f} MB/s){' verified' if args.verify else ''}"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from quads_megatron.demo.rl import main as demo_main

    return demo_main(args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="quads", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="HF safetensors (BF16) -> NVFP4 ModelOpt layout")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--exclude", action="append", default=[], help="glob on module names to keep BF16")
    c.add_argument("--include-shared-experts", action="store_true")
    c.add_argument("--input-amax", help="calibrated activation amax per module (.json or .safetensors)")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--verify", action="store_true", help="re-read the output and check it bit for bit")
    c.add_argument("--verify-only", action="store_true", help="only check an existing conversion")
    c.add_argument("--quiet", action="store_true")
    c.add_argument(
        "--megatron-base-hf",
        metavar="HF_DIR",
        help="SRC is a Megatron-Core dist checkpoint; HF_DIR (same model) gives config, tokenizer and names",
    )
    c.add_argument(
        "--non-expert-from",
        choices=("megatron", "hf"),
        default="megatron",
        help="with --megatron-base-hf: map attention/norm/embedding weights from SRC (Qwen2/3-MoE family; "
        "default) or copy them from HF_DIR",
    )
    c.add_argument("--quads-config", metavar="YAML", help="embed this QUADS config's rollout settings")
    c.add_argument(
        "--rac-plans",
        metavar="FILE",
        help="embed calibrated RAC plans (safetensors: <moe prefix>.w13 / .w2 -> int64 block indices)",
    )
    c.set_defaults(func=_convert)
    try:
        from quads_megatron.demo.rl import add_arguments
    except ImportError:  # the demo needs megatron-core
        add_arguments = None
    if add_arguments is not None:
        d = sub.add_parser("demo", help="CPU RL demo: BF16 vs naive NVFP4 vs QUADS rollout")
        add_arguments(d)
        d.set_defaults(func=_demo)
    args = ap.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
