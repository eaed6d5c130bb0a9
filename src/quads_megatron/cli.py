"""`quads` command line: convert checkpoints to NVFP4, run the CPU RL demo, run the RL study (`quads rl`)."""

from __future__ import annotations

import argparse
import sys

from quads_megatron import __version__

EXIT_USAGE = 2  # argparse: unknown option, missing argument
EXIT_INPUT = 3  # bad input or output location: refused with one line, nothing lost
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_UNFINISHED = 75  # quads rl: stopped at its time budget with work left (run it again to resume)

EXIT_CODES = f"""exit status:
  0    success
  {EXIT_USAGE}    usage error (unknown option, missing argument)
  {EXIT_INPUT}    the input or the output location was refused (one line on stderr says why;
       nothing at the destination was changed)
  {EXIT_UNFINISHED}   quads rl: stopped at --budget-s with work left (checkpointed; run it again to resume)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C); run the same command again to resume"""

CONVERT_EPILOG = f"""files:
  SRC (HF)          a directory with model.safetensors.index.json and its shards (or a single
                    *.safetensors), config.json, tokenizer files; BF16/FP16/FP32 weights
  SRC (Megatron)    with --megatron-base-hf: a Megatron-Core torch_dist checkpoint directory (any
                    EP/TP/PP layout; optimizer state is skipped)
  DST               written as DST.partial (resumable), published by renaming it to DST; a lock
                    file DST.lock keeps a second conversion out meanwhile
  --input-amax      JSON {{"model.layers.0.mlp.experts.0.gate_proj": 12.5, ...}} (a flat object of
                    numbers > 0) or safetensors {{module: tensor}} (the tensor's max is used); one
                    entry for every quantized linear. Without it every quantized linear gets
                    input_scale 1.0 (read by stock ModelOpt loaders only)
  --rac-plans       safetensors of int64 block indices named <moe prefix>.w13 and <moe prefix>.w2
                    (e.g. model.layers.0.mlp.experts.w13), a pair for every MoE layer; written by
                    examples/calibrate_rac.py
  --quads-config    the QUADS YAML (the trainer's): its nvfp4 section is the variant the weights are
                    quantized with (and recorded), its rollout section is embedded for the
                    quads_nvfp4 method

{EXIT_CODES}
"""


def _convert_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "convert",
        help="convert a BF16 checkpoint (HF or Megatron-Core dist) to NVFP4 in ModelOpt layout",
        description="Convert the MoE expert weights of a checkpoint to NVFP4 (ModelOpt layout, the trainer's\n"
        "exact codes and scales); everything else is kept as is. The output loads in SGLang with\n"
        "--quantization quads_nvfp4 (W4A4 + RAC) or modelopt_fp4 (native FP4, Blackwell).",
        epilog=CONVERT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("src", metavar="SRC", help="source checkpoint directory (HF safetensors, or see --megatron-base-hf)")
    c.add_argument("dst", metavar="DST", help="output directory; must not exist (unless --overwrite)")
    c.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="keep modules whose name matches GLOB (e.g. 'model.layers.0.*') in BF16; repeatable",
    )
    c.add_argument(
        "--include-shared-experts", action="store_true", help="also quantize shared experts (default: routed only)"
    )
    c.add_argument(
        "--input-amax",
        metavar="FILE",
        help="calibrated activation amax per quantized linear, .json or .safetensors (see files below); "
        "default: no calibration, input_scale 1.0",
    )
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it is an earlier output of quads convert (anything else is refused)",
    )
    c.add_argument(
        "--verify",
        action="store_true",
        help="before publishing, re-read the output and check every tensor bit for bit against the source",
    )
    c.add_argument(
        "--verify-only",
        action="store_true",
        help="write nothing; check an existing DST against SRC (pass the options it was converted with)",
    )
    c.add_argument("--quiet", action="store_true", help="no progress on stderr (warnings and errors still print)")
    c.add_argument(
        "--megatron-base-hf",
        metavar="HF_DIR",
        help="SRC is a Megatron-Core dist checkpoint (torch_dist); HF_DIR is the HF checkpoint of the same "
        "model, which gives config.json, the tokenizer, and the names and shapes of every tensor",
    )
    c.add_argument(
        "--non-expert-from",
        choices=("megatron", "hf"),
        default="megatron",
        help="with --megatron-base-hf: take attention, norm and embedding weights from SRC (mapped, "
        "Qwen2/Qwen3-MoE family; default) or copy them from HF_DIR",
    )
    c.add_argument(
        "--quads-config",
        metavar="YAML",
        help="quantize with this QUADS config's nvfp4 variant (4over6, ...) and embed its rollout settings "
        "(static RAC needs --rac-plans, static activation scales need --input-amax); default: plain NVFP4",
    )
    c.add_argument(
        "--rac-plans",
        metavar="FILE",
        help="embed calibrated RAC plans (safetensors, see files below); must cover every MoE layer",
    )
    c.set_defaults(func=_convert)


def _convert(args: argparse.Namespace) -> int:
    from quads_megatron.checkpoint import (
        UNCALIBRATED_INPUT_SCALE,
        ConvertOptions,
        convert_hf,
        convert_megatron_dist,
        load_input_amax,
        quads_extras,
        verify_conversion,
    )
    from quads_megatron.config import NVFP4Config, load_config
    from quads_megatron.errors import ConvertError, QuadsConfigError

    input_amax = load_input_amax(args.input_amax) if args.input_amax else {}
    rollout = None
    nvfp4_config = NVFP4Config()
    if args.quads_config:
        try:
            config = load_config(args.quads_config)
        except QuadsConfigError as e:
            raise ConvertError(f"{args.quads_config}: {e}") from e
        rollout, nvfp4_config = config.to_dict()["rollout"], config.nvfp4
    quads = quads_extras(rollout, args.rac_plans) if (rollout or args.rac_plans) else {}
    opts = ConvertOptions(
        nvfp4=nvfp4_config,
        quads=quads,
        include_shared_experts=args.include_shared_experts,
        exclude=tuple(args.exclude),
        input_amax=input_amax,
        overwrite=args.overwrite,
        verify=args.verify,
        progress=not args.quiet,
        source_paths=tuple(p for p in (args.input_amax, args.rac_plans, args.quads_config) if p),
    )
    if args.verify_only:
        n = verify_conversion(args.src, args.dst, opts)
        print(f"verified {n} tensors of {args.dst} against {args.src}")
        return 0
    if not input_amax:
        amax = UNCALIBRATED_INPUT_SCALE * nvfp4_config.activations.global_scale_numerator
        print(
            f"quads convert: warning: no --input-amax: every quantized linear gets input_scale "
            f"{UNCALIBRATED_INPUT_SCALE} (activation amax {amax:g}) for stock ModelOpt loaders; "
            "quads_nvfp4 uses dynamic per-token activation scales and ignores it",
            file=sys.stderr,
        )
    if args.megatron_base_hf:
        summary = convert_megatron_dist(
            args.src, args.dst, args.megatron_base_hf, opts, non_expert=args.non_expert_from
        )
        print(
            f"converted {summary['quantized_modules']} expert linears of {summary['layers']} layers -> {args.dst}"
            f"{' (verified)' if args.verify else ''}"
        )
        return 0
    summary = convert_hf(args.src, args.dst, opts)
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


def _rl_parser(sub: argparse._SubParsersAction) -> None:
    from quads_megatron.rl import command

    r = sub.add_parser(
        "rl",
        help="RL study on one GPU: Megatron trainer + colocated SGLang rollout, BF16 vs naive NVFP4 vs QUADS",
        description=command.DESCRIPTION,
        epilog=command.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_arguments(r)
    r.set_defaults(func=lambda args: command.main(args, r))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="quads",
        description="QUADS NVFP4 tools: convert checkpoints for the NVFP4 rollout; run the CPU RL demo and the "
        "RL study.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"quads {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{convert,demo,rl}")
    _convert_parser(sub)
    try:
        from quads_megatron.demo.rl import add_arguments
    except ImportError:  # the demo needs megatron-core
        add_arguments = None
    if add_arguments is not None:
        d = sub.add_parser(
            "demo",
            help="CPU RL demo on a small Megatron-Core MoE: BF16 vs naive NVFP4 vs QUADS rollout",
            description="Train a small Megatron-Core MoE with RL on CPU and compare BF16, naive NVFP4 and "
            "QUADS rollouts (needs megatron-core).",
        )
        add_arguments(d)
        d.set_defaults(func=_demo)
    _rl_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    import os

    from quads_megatron.errors import QuadsError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "convert" and args.verify_only and args.megatron_base_hf:
        parser.error("--verify-only checks a conversion of an HF checkpoint; for a Megatron one use --verify")
    prog = f"quads {args.cmd}"
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        msg = "interrupted"
        if args.cmd == "convert" and not args.verify_only:
            partial = os.path.realpath(args.dst) + ".partial"
            msg += f"; the partial output {partial} is kept: run the same command again to resume"
        if args.cmd == "rl":
            msg += "; run the same command again to resume from the last checkpoint"
        print(f"{chr(10) if sys.stderr.isatty() else ''}{prog}: {msg}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except QuadsError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"{prog}: error: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
