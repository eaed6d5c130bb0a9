"""End-to-end SGLang Engine throughput of a Qwen3-30B-A3B-shaped model: bf16, SGLang's online `fp8` (as
shipped, and `fp8_tuned`: with the fused-MoE kernel configs bench_moe_block.py tuned on this GPU, passed as
--peer-configs and served through SGLANG_MOE_CONFIG_DIR), and quads_nvfp4 with RAC off / dynamic 50% /
static 50% (quads_dyn_rows: dynamic 50% on row-major expert weights, the A/B of the tiled layout).

The model: 128 experts, hidden 2048, moe intermediate 768, top-8, 32 heads / 4 KV heads / head_dim 128,
vocab --vocab (32768 saves memory and time), --layers layers (>= 12: with fewer, a decode step is mostly the
engine's CPU work); random weights written straight to per-layer safetensors shards from GPU tensors, then
`quads convert` once (timed; CPU-bound) with static RAC plans and input scales calibrated on random hidden
states (for timing only: the cost depends on the channel count, not on which channels). Each quads arm
serves the converted tensors through its own folder (symlinks) whose quantization config selects its mode.

Each arm runs in its own process (one Engine, shut down at the end; a crash or hang stays there). Per
batch B: a warm-up, then --repeats times B fresh random prompts of --input-len tokens with max_new_tokens=1
(prefill) and with max_new_tokens=--new-tokens, ignore_eos (the window): output tok/s = B * new / window,
decode tok/s = B * (new - 1) / (window - prefill), step = (window - prefill) / (new - 1). Median / min / max.
Each arm first decodes a fixed probe (PROBE prompts, greedy): quads arms of the same numbers (quads_dyn and
quads_dyn_rows: the same bits on either weight layout) must give the same tokens, which the report checks.
The 'layercheck' arm runs quads dynamic on the first --check-layers layers: per-layer and fixed per-step
time from the two step times say whether the GPU's work dominates a decode step.

    python benchmarks/bench_engine.py --prepare-only                      # model + conversion (~3-5 min)
    python benchmarks/bench_engine.py --arms bf16,fp8 --resume             # ~3 min per arm
    python benchmarks/bench_engine.py --arms quads_off,quads_dyn --resume
    python benchmarks/bench_engine.py --arms quads_static,layercheck --resume
    python benchmarks/bench_engine.py --arms fp8_tuned --resume --peer-configs OUT/sglang_fp8_tensor_tuned.json
    python benchmarks/bench_engine.py --dry-run                            # CPU: tiny model, no engines

Writes OUT/bench_engine.json and .md (OUT: --out, else $OUT, else benchmarks/results) and a copy of the
JSON in the workdir. --resume [PATH] merges into an earlier JSON of the same settings (PATH, else the first
of OUT/, the workdir's copy, benchmarks/results/) and skips the arms and batches it already holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time

import bench_env
from bench_engine_model import QUADS_ARMS, prepare

ARMS = ("bf16", "fp8", "fp8_tuned", *QUADS_ARMS, "layercheck")
#: the arms measured against (fp8_tuned: SGLang's fp8 with the fused-MoE configs of --peer-configs)
PEERS = ("fp8", "fp8_tuned", "bf16")
#: the committed results (the default --out, and the last place --resume looks)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: process groups of the arms running now (each started in a new process group: killed as a whole)
RUNNING: set[int] = set()


# ----------------------------------------------------------------------------- one arm (child process)


def engine_kwargs(spec: dict) -> dict:
    max_bs = max(spec["batches"])
    kw = dict(
        model_path=spec["model"],
        skip_tokenizer_init=True,
        attention_backend="triton",
        sampling_backend="pytorch",
        grammar_backend="none",
        mem_fraction_static=spec["mem_fraction"],
        cuda_graph_max_bs_decode=max_bs,
        max_running_requests=max_bs,
        disable_radix_cache=True,
        context_length=spec["input_len"] + spec["new_tokens"] + 16,
        random_seed=0,
        log_level="warning",
    )
    if spec["quantization"]:
        kw["quantization"] = spec["quantization"]
    return kw


MOE_CONFIGS_MARK = ".quads_bench_moe_configs"


def moe_configs_root(args) -> str:
    """Where the fp8_tuned arm's SGLANG_MOE_CONFIG_DIR lives (inside the workdir)."""
    return os.path.join(args.workdir, "sglang_moe_configs")


def moe_config_dir(root: str, peers: list[dict], triton_version: str) -> str:
    """An SGLANG_MOE_CONFIG_DIR holding the tuned fused-MoE configs of peers (read_peer_file's checked
    bench_moe_block.py TUNED_FILES: {"file": SGLang's name, "configs": {tokens: config}}) at
    configs/triton_<version>/<file>. Rewritten on every call; an existing root is removed only when it is one
    this function wrote (its mark and SGLang config files, nothing else). Returns root."""
    if os.path.lexists(root):
        found = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]
        own = [f for f in found if f == MOE_CONFIGS_MARK or (f.startswith("configs/triton_") and f.endswith(".json"))]
        if MOE_CONFIGS_MARK not in found or len(own) != len(found) or os.path.islink(root):
            raise RuntimeError(f"{root} holds files this benchmark did not write; remove it or use another --workdir")
        shutil.rmtree(root)
    sub = os.path.join(root, "configs", "triton_" + triton_version.replace(".", "_"))
    os.makedirs(sub)
    with open(os.path.join(root, MOE_CONFIGS_MARK), "w") as f:
        f.write("written by benchmarks/bench_engine.py\n")
    for peer in peers:
        bench_env.write_json(os.path.join(sub, peer["file"]), peer["configs"])
    return root


def config_misses(log_text: str) -> list[str]:
    """SGLang's warnings in an arm's log that it found no tuned FP8 fused-MoE config (it logs a found one at
    info level only, which the engines here do not print): the fp8_tuned arm must have none. A missing
    `_down` file is not one: SGLang then runs the down projection with the tuned up-projection config."""
    keys = ("Config file not found", "Using default MoE kernel config")
    return sorted(
        {
            ln.strip()[:300]
            for ln in log_text.splitlines()
            if "fp8_w8a8" in ln and "_down" not in ln and any(k in ln for k in keys)
        }
    )


def config_used(log_text: str, root: str) -> bool:
    """Whether an arm's log shows SGLang reading a fused-MoE config under root: its info line for a found
    file, or its warning that it reuses the found up-projection config for the down projection (no
    `_down` file is written). Neither: the engine may not have run SGLang's Triton MoE with these files."""
    keys = ("Using MoE kernel config from", "reusing the tuned up-projection config")
    return any(root in ln and any(k in ln for k in keys) for ln in log_text.splitlines())


def peer_configs_of(peers: list[dict]) -> dict:
    """{SGLang file name: {tokens: config}} of the tuned-config files (what an fp8_tuned result ran with)."""
    return {peer["file"]: peer["configs"] for peer in peers}


def peer_coverage(peers: list[dict], batches: list[int], input_len: int) -> list[str]:
    """Where a tuned-config file stops short of the engine's forwards: SGLang takes the config of the token
    count nearest each forward's, so prefill forwards (up to max(batch) x input_len tokens, chunked by SGLang)
    past the file's largest entry run on that entry's config. One line per such file (none: covered)."""
    longest = max(batches) * input_len
    out = []
    for peer in peers:
        top = max(int(k) for k in peer["configs"])
        if top < longest:
            out.append(
                f"{peer['file']}: tuned up to {top} tokens; prefill forwards of up to {longest} tokens take its "
                f"{top}-token config (tune the block at the engine's prefill sizes too)"
            )
    return out


def read_peer_file(path: str) -> dict:
    """A tuned-config file of bench_moe_block.py, checked: {"file": "E=...json", "configs": {tokens: {...}}}."""
    with open(path) as f:
        peer = json.load(f)
    name, configs = (peer.get("file"), peer.get("configs")) if isinstance(peer, dict) else (None, None)
    if not (isinstance(name, str) and name.startswith("E=") and name.endswith(".json") and "/" not in name):
        raise ValueError(f"{path}: not a tuned-config file of bench_moe_block.py (no SGLang file name)")
    if not (
        isinstance(configs, dict) and configs and all(k.isdigit() and isinstance(v, dict) for k, v in configs.items())
    ):
        raise ValueError(f"{path}: 'configs' must map token counts to kernel configs")
    return peer


PROBE = {"prompts": 4, "input_len": 32, "new_tokens": 32, "seed": 1234}
#: arms whose probe tokens must equal quads_dyn's (the same numbers through other code)
SAME_TOKENS = {"quads_dyn_rows": "quads_dyn"}


def probe_ids(engine, vocab: int) -> list[list[int]]:
    """The output ids of PROBE's fixed random prompts, greedy, in one batch."""
    rng = random.Random(PROBE["seed"])
    prompts = [[rng.randrange(vocab) for _ in range(PROBE["input_len"])] for _ in range(PROBE["prompts"])]
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": PROBE["new_tokens"]}
    return [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]


def token_checks(results: dict) -> dict:
    """{arm: True/False}: whether an arm of SAME_TOKENS decoded the probe to its reference arm's tokens."""
    arms = results.get("arms", {})
    return {
        a: arms[a]["probe_ids"] == arms[ref]["probe_ids"]
        for a, ref in SAME_TOKENS.items()
        if arms.get(a, {}).get("probe_ids") and arms.get(ref, {}).get("probe_ids")
    }


def time_batch(engine, b: int, spec: dict, prompts) -> dict:
    """Warm-up, then per repeat the prefill (max_new_tokens=1) and the window (new tokens) of b requests."""
    new = spec["new_tokens"]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=prompts(b), sampling_params={**greedy, "max_new_tokens": 8})
    reps = []
    for _ in range(spec["repeats"]):
        t = time.perf_counter()
        engine.generate(input_ids=prompts(b), sampling_params={**greedy, "max_new_tokens": 1})
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        res = engine.generate(input_ids=prompts(b), sampling_params={**greedy, "max_new_tokens": new})
        window = time.perf_counter() - t
        tokens = sum(len(r["output_ids"]) for r in res)
        if tokens != b * new:
            raise RuntimeError(f"batch {b}: {tokens} output tokens, expected {b * new}")
        decode = max(window - prefill, 1e-9)
        reps.append({"prefill_s": prefill, "window_s": window, "output_tokens": tokens})
        reps[-1].update(output_tok_s=tokens / window, decode_tok_s=b * (new - 1) / decode)
        reps[-1]["step_ms"] = decode / (new - 1) * 1e3
    row = {k: bench_env.stats([r[k] for r in reps]) for k in ("output_tok_s", "decode_tok_s", "step_ms")}
    return {**row, "repeats": reps}


def run_arm(spec: dict, save) -> dict:
    """Start one Engine, time every batch size (save(out) after each: a run cut short keeps what it
    measured), shut it down. A batch that fails is recorded under 'errors' and the next one runs."""
    from sglang.srt.entrypoints.engine import Engine

    from quads_megatron.integrations.sglang_versions import check_version

    if spec["quantization"] == "quads_nvfp4":
        check_version()  # outside the supported range the engine's scheduler would refuse the plugin later
    out: dict = {}
    rng = random.Random(spec["seed"])

    def prompts(b: int) -> list[list[int]]:
        return [[rng.randrange(spec["vocab"]) for _ in range(spec["input_len"])] for _ in range(b)]

    t0 = time.time()
    engine = Engine(**engine_kwargs(spec))
    out.update(startup_s=time.time() - t0, batches={}, errors={})
    out["probe_ids"] = probe_ids(engine, spec["vocab"])
    save(out)
    try:
        for b in spec["batches"]:
            try:
                out["batches"][str(b)] = time_batch(engine, b, spec, prompts)
                print(f"arm {spec['arm']} batch {b}: {out['batches'][str(b)]['output_tok_s']['median']:.0f} tok/s")
            except Exception as e:
                out["errors"][str(b)] = f"{type(e).__name__}: {e}"[:1000]
                print(f"arm {spec['arm']} batch {b} failed: {out['errors'][str(b)]}")
            save(out)
    finally:
        engine.shutdown()
    out["seconds"] = time.time() - t0
    return out


def child_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    head = bench_env.header()

    def save(out: dict) -> None:
        bench_env.write_json(spec["fragment"], {"ok": True, **head, **out})

    try:
        save(run_arm(spec, save))
        return 0
    except Exception as e:
        import traceback

        err = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        partial = {}
        if os.path.exists(spec["fragment"]):
            with open(spec["fragment"]) as f:
                partial = json.load(f)
        bench_env.write_json(spec["fragment"], {**partial, **head, "ok": False, **err})
        return 1


# ----------------------------------------------------------------------------- results


def check_gpu_bound(results: dict, moe_block: dict | None = None) -> dict:
    """From the full model's and the layer-subset's decode step times (quads dynamic, same batch):
    per-layer and fixed per-step time, and the layers' share of a step; with moe_block.json rows, also
    the expected MoE kernel time per step. share >= 0.7: the GPU's work dominates."""
    full = results.get("arms", {}).get("quads_dyn", {}).get("batches", {})
    sub = results.get("arms", {}).get("layercheck", {}).get("batches", {})
    layers, n = results["settings"]["layers"], results["settings"]["check_layers"]
    out = {}
    for b, row in sub.items():
        if b not in full or layers <= n:
            continue
        step_l, step_n = full[b]["step_ms"]["median"], row["step_ms"]["median"]
        per_layer = (step_l - step_n) / (layers - n)
        share = layers * per_layer / step_l
        out[b] = {"step_ms": step_l, "step_ms_subset": step_n, "per_layer_ms": per_layer}
        out[b].update(fixed_ms=step_l - layers * per_layer, layer_share=share, gpu_bound=share >= 0.7)
        for r in (moe_block or {}).get("rows", []):
            if str(r["tokens"]) == b and r.get("ours_rac50_us"):
                out[b]["moe_kernels_ms"] = layers * r["ours_rac50_us"] / 1e3
                out[b]["moe_share"] = out[b]["moe_kernels_ms"] / step_l
    return out


def ratios(results: dict) -> dict:
    """Median output tok/s of each quads arm over each peer (fp8, fp8_tuned, bf16), and of quads_dyn (tiled
    expert weights) over quads_dyn_rows (row-major), per batch."""
    arms = results.get("arms", {})
    out: dict = {}
    for q in QUADS_ARMS:
        for peer in PEERS:
            for b, row in arms.get(q, {}).get("batches", {}).items():
                peer_row = arms.get(peer, {}).get("batches", {}).get(b)
                if peer_row:
                    out.setdefault(f"{q}/{peer}", {})[b] = (
                        row["output_tok_s"]["median"] / peer_row["output_tok_s"]["median"]
                    )
    for b, row in arms.get("quads_dyn", {}).get("batches", {}).items():  # the tiled layout's A/B
        rows_row = arms.get("quads_dyn_rows", {}).get("batches", {}).get(b)
        if rows_row:
            out.setdefault("quads_dyn/quads_dyn_rows", {})[b] = (
                row["output_tok_s"]["median"] / rows_row["output_tok_s"]["median"]
            )
    return out


def merge_arm(results: dict, arm: str, frag: dict) -> None:
    """Put one arm's fragment into results, keeping batches an earlier run measured and this one did not."""
    old = results.setdefault("arms", {}).get(arm, {})
    new = {k: v for k, v in frag.items() if k != "batches"}
    new["batches"] = {**old.get("batches", {}), **frag.get("batches", {})}
    results["arms"][arm] = new


def markdown(results: dict) -> str:
    f = bench_env.fmt
    s = results["settings"]
    batches = sorted({int(b) for a in results.get("arms", {}).values() for b in a.get("batches", {})})
    lines = ["# SGLang Engine throughput: quads_nvfp4 vs fp8 vs bf16", "", *bench_env.header_lines(results), ""]
    lines += [
        f"{'Tiny (dry run)' if s['tiny'] else 'Qwen3-30B-A3B-shaped'} model, {s['layers']} layers, vocab {s['vocab']}, "
        f"random weights; {s['input_len']} "
        f"input tokens, {s['new_tokens']} new tokens (ignore_eos, greedy), {s['repeats']} repeats (median, min-max).",
        "Static RAC plans and input scales come from random hidden states (timing only). Engine: triton attention,",
        "CUDA graphs up to the largest batch, radix cache off. Output tok/s = B * new tokens / window.",
        "",
    ]
    p = results.get("prepare", {})
    if p.get("convert"):
        c = p["convert"]
        lines += [
            f"Checkpoint: {p['write']['bytes'] / 1e9:.2f} GB bf16 written in {p['write']['write_s']:.0f} s; "
            f"`quads convert` {c['seconds']:.0f} s ({c['mb_per_s_in']:.0f} MB/s in, {c['bytes_out'] / 1e9:.2f} GB "
            f"out, {c['cpu_count']} CPUs).",
            "",
        ]
    arms = [a for a in ARMS if a != "layercheck" and a in results.get("arms", {})]
    for key, title, spec in (("output_tok_s", "Output tok/s", ".0f"), ("decode_tok_s", "Decode tok/s", ".0f"),
                             ("step_ms", "Decode step, ms", ".2f")):  # fmt: skip
        rows = []
        for b in batches:
            cells = [str(b)]
            for a in arms:
                r = results["arms"][a].get("batches", {}).get(str(b))
                cells.append(
                    f"{f(r[key]['median'], spec)} ({f(r[key]['min'], spec)}-{f(r[key]['max'], spec)})" if r else "-"
                )
            rows.append(cells)
        if arms and batches:
            lines += [f"{title}:", "", *bench_env.table(["batch", *arms], rows), ""]
    rat = results.get("ratios", {})
    if rat:
        cols = sorted(rat)
        rows = [[str(b), *[f(rat[c].get(str(b)), ".2f") for c in cols]] for b in batches]
        lines += ["Ratios of median output tok/s:", "", *bench_env.table(["batch", *cols], rows), ""]
    for a, r in sorted(results.get("arms", {}).items()):
        if not r.get("ok", True):
            lines.append(f"- {a}: FAILED: {r.get('error')}")
            continue
        if r.get("startup_s") is not None:
            lines.append(f"- {a}: engine start {r['startup_s']:.0f} s")
        for b, e in sorted(r.get("errors", {}).items()):
            lines.append(f"- {a}: batch {b} FAILED: {e}")
        for miss in r.get("config_misses", []):
            lines.append(f"- {a}: WARNING, SGLang found no tuned config here (the arm is not tuned): {miss}")
        for short in r.get("config_coverage", []):
            lines.append(f"- {a}: WARNING, {short}")
        if r.get("error"):
            lines.append(f"- {a}: {r['error']}")
    for a, same in sorted(token_checks(results).items()):
        verdict = "the same tokens" if same else "FAILED: other tokens"
        lines.append(f"- {a}: probe ({PROBE['prompts']} greedy prompts) vs {SAME_TOKENS[a]}: {verdict}")
    chk = results.get("gpu_bound_check", {})
    if chk:
        lines += ["", f"GPU-bound check (quads dynamic, {s['layers']} vs {s['check_layers']} layers):", ""]
        for b, c in sorted(chk.items(), key=lambda kv: int(kv[0])):
            moe = (
                f", MoE kernels {c['moe_kernels_ms']:.2f} ms ({100 * c['moe_share']:.0f}%)" if "moe_share" in c else ""
            )
            lines.append(
                f"- batch {b}: step {c['step_ms']:.2f} ms = {s['layers']} x {c['per_layer_ms']:.3f} ms per layer + "
                f"{c['fixed_ms']:.2f} ms fixed; layers {100 * c['layer_share']:.0f}% of a step "
                f"({'GPU-bound' if c['gpu_bound'] else 'WARN: fixed per-step cost large'}){moe}"
            )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--arms",
        default=",".join(a for a in ARMS if a != "fp8_tuned"),
        help=f"comma-separated subset of {','.join(ARMS)} (default: all but fp8_tuned, which needs --peer-configs)",
    )
    ap.add_argument("--batches", default="16,64,256,1024")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-layers", type=int, default=4, help="layers of the 'layercheck' arm's model")
    ap.add_argument("--check-batches", default="64,256", help="batches of the 'layercheck' arm")
    ap.add_argument("--mem-fraction", type=float, default=0.8, help="SGLang mem_fraction_static (one engine at a time)")
    ap.add_argument("--arm-timeout", type=int, default=540, help="seconds one arm's process may run")
    ap.add_argument(
        "--peer-configs",
        default="",
        metavar="PATHS",
        help="comma-separated tuned fused-MoE config files of bench_moe_block.py (sglang_fp8_*_tuned.json) "
        "the fp8_tuned arm serves with",
    )
    ap.add_argument("--workdir", default="/tmp/quads_bench_engine", help="model, conversion, logs")
    ap.add_argument("--out", help="results folder (default: $OUT, else benchmarks/results; dry run: workdir/out)")
    ap.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        metavar="PATH",
        help="merge into an earlier bench_engine.json (default: OUT's, the workdir's, benchmarks/results'), "
        "skipping what it holds",
    )
    ap.add_argument("--prepare-only", action="store_true", help="write and convert the model, run no engine")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny model, conversion and outputs, no engine")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (implied by --dry-run)")
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return args

    def ints(name: str, text: str) -> list[int]:
        try:
            vals = [int(v) for v in text.split(",") if v]
        except ValueError:
            ap.error(f"--{name}: expected comma-separated integers, got {text!r}")
        if not vals or min(vals) < 1:
            ap.error(f"--{name}: expected positive integers, got {text!r}")
        return vals

    args.batches, args.check_batches = ints("batches", args.batches), ints("check-batches", args.check_batches)
    args.arms = [a for a in args.arms.split(",") if a]
    bad = sorted(set(args.arms) - set(ARMS))
    if bad:
        ap.error(f"--arms: unknown {bad} (known: {', '.join(ARMS)})")
    for name in ("layers", "vocab", "input_len", "new_tokens", "repeats", "check_layers"):
        if getattr(args, name) < (2 if name == "new_tokens" else 1):
            ap.error(f"--{name.replace('_', '-')}: too small ({getattr(args, name)})")
    if "layercheck" in args.arms and args.check_layers >= args.layers:
        ap.error(f"--check-layers ({args.check_layers}) must be below --layers ({args.layers})")
    if not 0 < args.mem_fraction < 1:
        ap.error(f"--mem-fraction: must be in (0, 1), got {args.mem_fraction}")
    args.peer_configs = [p for p in args.peer_configs.split(",") if p]
    if "fp8_tuned" in args.arms and not args.peer_configs:
        ap.error("--arms fp8_tuned needs --peer-configs (bench_moe_block.py's sglang_fp8_*_tuned.json)")
    names: dict[str, str] = {}
    args.peers = []  # the files read and checked once, here, before anything is written
    for path in args.peer_configs:
        try:
            args.peers.append(read_peer_file(path))
        except (OSError, ValueError) as e:
            ap.error(f"--peer-configs: {e}")
        name = args.peers[-1]["file"]
        if name in names:
            ap.error(f"--peer-configs: {names[name]} and {path} are both {name} (one would overwrite the other)")
        names[name] = path
    args.tiny = args.tiny or args.dry_run
    if args.out is None:
        results = RESULTS
        args.out = os.path.join(args.workdir, "out") if args.dry_run else os.environ.get("OUT") or results
    return args


def settings_of(args) -> dict:
    return {
        "layers": args.layers, "vocab": args.vocab, "input_len": args.input_len, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "check_layers": args.check_layers, "tiny": args.tiny,
    }  # fmt: skip


def resume_path(args) -> str | None:
    """The earlier results --resume merges into (None: start afresh)."""
    if not args.resume:
        return None
    if args.resume != "auto":
        if not os.path.exists(args.resume):
            raise SystemExit(f"bench_engine: --resume {args.resume}: no such file")
        return args.resume
    here = os.path.join(RESULTS, "bench_engine.json")
    for path in (os.path.join(args.out, "bench_engine.json"), os.path.join(args.workdir, "bench_engine.json"), here):
        if os.path.exists(path):
            return path
    return None


def load_results(args) -> dict:
    """A fresh result set, or the earlier one --resume names (its settings and device must be this run's:
    ratios between arms timed on different GPUs would mislead)."""
    settings = settings_of(args)
    path = resume_path(args)
    if path is None:
        return {"settings": settings, "arms": {}}
    with open(path) as f:
        results = json.load(f)
    if results.get("settings") != settings:
        raise SystemExit(
            f"bench_engine: --resume: {path} holds settings {results.get('settings')}, this run {settings}; "
            "use the same settings or another --out"
        )
    ran = results.get("arms", {}).get("fp8_tuned", {}).get("peer_configs")
    if "fp8_tuned" in args.arms and ran is not None and ran != peer_configs_of(args.peers):
        raise SystemExit(
            f"bench_engine: --resume: {path}'s fp8_tuned ran with other tuned configs than --peer-configs; "
            "pass the same files or another --out"
        )
    there, here = (results.get("device") or {}).get("name"), bench_env.device_info()["name"]
    if there is not None and there != here:
        raise SystemExit(
            f"bench_engine: --resume: {path} was measured on {there}, this is {here}; rerun every arm here "
            "(another --out) or resume on that device"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)

    def log(msg: str) -> None:
        print(msg, flush=True)

    import signal

    import torch

    def stop(signum, frame):  # a timeout around this script must not leave an engine holding the GPU
        for pgid in list(RUNNING):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    args.device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.device == "cpu" and not (args.dry_run or args.prepare_only):
        print("bench_engine: engines need a CUDA GPU; use --dry-run or --prepare-only here", file=sys.stderr)
        return 2
    json_path = os.path.join(args.out, "bench_engine.json")
    results = load_results(args)
    results.update(bench_env.header())
    prep = prepare(args, log)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    results["prepare"] = {k: v for k, v in prep.items() if k != "dirs"}
    log(f"PASS prepare: {json.dumps(results['prepare'].get('convert', {}), default=float)[:300]}")
    if not (args.dry_run or args.prepare_only):
        os.makedirs(os.path.join(args.workdir, "logs"), exist_ok=True)
        for arm in args.arms:
            batches = args.check_batches if arm == "layercheck" else args.batches
            have = results["arms"].get(arm, {})
            if args.resume and have.get("ok") and all(str(b) in have.get("batches", {}) for b in batches):
                log(f"SKIP {arm}: in {json_path} already")
                continue
            frag = run_child(arm, batches, prep["dirs"][arm], args, log)
            if arm == "fp8_tuned":
                with open(os.path.join(args.workdir, "logs", f"{arm}.log"), errors="replace") as f:
                    text = f.read()
                frag["config_misses"] = config_misses(text)
                if not config_used(text, moe_configs_root(args)):
                    frag["config_misses"].append("no sign in its log that SGLang read the tuned configs")
                frag["config_coverage"] = peer_coverage(args.peers, batches, args.input_len)
                frag["peer_configs"] = peer_configs_of(args.peers)
                for line in frag["config_misses"]:
                    log(f"WARN fp8_tuned: SGLang did not use a tuned config: {line}")
                for line in frag["config_coverage"]:
                    log(f"WARN fp8_tuned: {line}")
            merge_arm(results, arm, frag)
            finish(results, json_path, args)
    finish(results, json_path, args)
    chk = results.get("gpu_bound_check", {})
    for b, c in chk.items():
        log(
            f"{'PASS' if c['gpu_bound'] else 'WARN'} GPU-bound check batch {b}: "
            f"layers {100 * c['layer_share']:.0f}% of a step"
        )
    failed = [a for a in args.arms if not results["arms"].get(a, {}).get("ok", True)]
    return 1 if failed else 0


def run_child(arm: str, batches: list[int], model: str, args, log) -> dict:
    """One arm in its own process, killed (its process group) after --arm-timeout seconds."""
    import signal

    spec = {
        "arm": arm, "model": model, "batches": batches, "input_len": args.input_len, "new_tokens": args.new_tokens,
        "repeats": 1 if arm == "layercheck" else args.repeats, "vocab": args.vocab, "mem_fraction": args.mem_fraction,
        "quantization": {"bf16": None, "fp8": "fp8", "fp8_tuned": "fp8"}.get(arm, "quads_nvfp4"), "seed": 0,
        "fragment": os.path.join(args.workdir, "logs", f"{arm}.json"),
    }  # fmt: skip
    spec_path = os.path.join(args.workdir, "logs", f"{arm}.spec.json")
    bench_env.write_json(spec_path, spec)
    if os.path.exists(spec["fragment"]):
        os.remove(spec["fragment"])
    log_path = os.path.join(args.workdir, "logs", f"{arm}.log")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    if env.pop("SGLANG_MOE_CONFIG_DIR", None) is not None:  # every arm but fp8_tuned runs SGLang's own configs
        log(f"arm {arm}: SGLANG_MOE_CONFIG_DIR of this shell not passed on")
    if arm == "fp8_tuned":
        import triton

        env["SGLANG_MOE_CONFIG_DIR"] = moe_config_dir(moe_configs_root(args), args.peers, triton.__version__)
    log(f"arm {arm}: batches {batches} on {model} (log {log_path})")
    t0 = time.time()
    with open(log_path, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", spec_path],
            stdout=f, stderr=subprocess.STDOUT, env=env, process_group=0,
        )  # fmt: skip
        RUNNING.add(proc.pid)
        timed_out = False
        try:
            proc.wait(timeout=args.arm_timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=30)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        RUNNING.discard(proc.pid)
    frag = {"ok": False, "error": f"no result (exit {proc.returncode}, {time.time() - t0:.0f} s)"}
    if os.path.exists(spec["fragment"]):
        with open(spec["fragment"]) as fh:
            frag = json.load(fh)
    if timed_out:
        frag["error"] = f"timed out after {args.arm_timeout} s; kept the batches measured before"
    missing = [b for b in batches if str(b) not in frag.get("batches", {})]
    if not frag.get("ok") or missing:
        with open(log_path, errors="replace") as fh:
            frag["log_tail"] = fh.read()[-3000:]
        log(f"FAIL {arm} (batches {missing} missing): {frag.get('error')} {frag.get('errors', '')}")
        log(frag["log_tail"][-1500:])
    else:
        log(f"PASS {arm}: start {frag['startup_s']:.0f} s, total {time.time() - t0:.0f} s")
    return frag


def finish(results: dict, json_path: str, args) -> None:
    results["ratios"] = ratios(results)
    moe_block = None
    for folder in (args.out, RESULTS):
        path = os.path.join(folder, "moe_block.json")
        if moe_block is None and os.path.exists(path):
            with open(path) as f:
                moe_block = json.load(f)
    results["gpu_bound_check"] = check_gpu_bound(results, moe_block)
    bench_env.write_json(json_path, results)
    bench_env.write_json(os.path.join(args.workdir, "bench_engine.json"), results)
    bench_env.write_text(os.path.join(args.out, "bench_engine.md"), markdown(results))


if __name__ == "__main__":
    raise SystemExit(main())
