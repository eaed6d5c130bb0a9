"""HF safetensors checkpoint (BF16) -> NVFP4 ModelOpt layout, streaming, atomic and resumable.

One source shard at a time (plus a first pass that reads gate/up amaxes); output is written to
``<dst>.partial`` with a state file (resumable), then renamed to ``<dst>``.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quads_megatron import __version__, nvfp4
from quads_megatron.checkpoint.modelopt import (
    INDEX,
    ConvertOptions,
    check_weight,
    classify,
    excluded_linears,
    modelopt_tensors,
    pair_module,
    quantize_linear,
    write_quant_configs,
)
from quads_megatron.checkpoint.output import (
    STATE,
    Progress,
    copy_side_files,
    load_state,
    save_state,
    source_fingerprint,
)
from quads_megatron.errors import ConvertError


def read_shards(src: str) -> dict[str, list[str]]:
    """shard file -> parameter names, from the index (or the single model.safetensors)."""
    index_path = os.path.join(src, INDEX)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ConvertError(f"{index_path}: unreadable safetensors index ({e})") from e
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
    else:
        files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
        if len(files) != 1:
            raise ConvertError(f"{src}: no {INDEX} and {len(files)} .safetensors files (expected exactly one)")
        shards = {files[0]: []}
    for shard in shards:
        path = os.path.join(src, shard)
        if not os.path.exists(path):
            raise ConvertError(f"{src}: the index names {shard}, which is missing (half-written checkpoint?)")
        try:
            with safe_open(path, "pt") as f:
                keys = list(f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise ConvertError(f"{path}: not a readable safetensors file ({e})") from e
        if shards[shard] and set(shards[shard]) != set(keys):
            raise ConvertError(f"{path}: tensors differ from what {INDEX} lists (half-written checkpoint?)")
        shards[shard] = keys
    return shards


def convert_hf(src: str, dst: str, opts: ConvertOptions | None = None) -> dict[str, object]:
    """Convert an HF safetensors checkpoint directory to NVFP4 ModelOpt layout at dst.

    Returns a summary (quantized modules, bytes in/out, seconds). Raises ConvertError on bad
    input; dst is only created, by an atomic rename, once everything was written.
    """
    opts = opts or ConvertOptions()
    t0 = time.time()
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: not a directory")
    if os.path.exists(dst) and not opts.overwrite:
        raise ConvertError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
    shards = read_shards(src)
    names = [n for keys in shards.values() for n in keys]
    targets = {n: c for n in names if (c := classify(n, opts)) is not None}
    if not targets:
        raise ConvertError(
            f"{src}: no MoE expert weights recognised (expected names like "
            "'model.layers.0.mlp.experts.0.gate_proj.weight' or '...block_sparse_moe.experts.0.w1.weight')"
        )
    modules = {mod for mod, _ in targets.values()}
    for mod in modules:
        partner = pair_module(mod)
        if partner is not None and partner not in modules:
            raise ConvertError(f"{mod}: its gate/up partner {partner} is missing or excluded")
    unknown_calib = sorted(set(opts.input_amax) - modules)
    if unknown_calib:
        raise ConvertError(f"input_amax names modules that are not quantized: {unknown_calib[:3]}")

    partial = dst.rstrip("/") + ".partial"
    fingerprint = {"source": source_fingerprint(src, shards), "options": opts.fingerprint(), "version": __version__}
    state = load_state(partial, fingerprint)

    amaxes = state.get("amax") or _gate_up_amaxes(src, shards, targets)
    state["amax"] = amaxes
    progress = Progress(len(shards), opts.progress)
    weight_map: dict[str, str] = {}
    bytes_in = bytes_out = 0
    for shard, keys in shards.items():
        out_keys = state.setdefault("done", {}).get(shard)
        if out_keys is None:
            out: dict[str, torch.Tensor] = {}
            with safe_open(os.path.join(src, shard), "pt") as f:
                for name in keys:
                    t = f.get_tensor(name)
                    bytes_in += t.numel() * t.element_size()
                    if name in targets:
                        mod, _ = targets[name]
                        amax = amaxes.get(mod)
                        q = quantize_linear(t, name, torch.tensor(amax) if amax is not None else None)
                        out.update(modelopt_tensors(mod, q, opts.input_amax.get(mod)))
                    else:
                        out[name] = t
            save_file(out, os.path.join(partial, shard), metadata={"format": "pt"})
            bytes_out += sum(v.numel() * v.element_size() for v in out.values())
            out_keys = sorted(out)
            state["done"][shard] = out_keys
            save_state(partial, state)
        weight_map.update({k: shard for k in out_keys})
        progress.step(shard)

    with open(os.path.join(partial, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": bytes_out}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    exclude = sorted(excluded_linears(names, targets))
    write_quant_configs(src, partial, exclude, opts.quads)
    copy_side_files(src, partial)
    if opts.verify:
        verify_conversion(src, partial, opts)
    os.remove(os.path.join(partial, STATE))
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.rename(partial, dst)
    return {
        "quantized_modules": len(modules),
        "shards": len(shards),
        "bytes_in_this_run": bytes_in,
        "bytes_out_this_run": bytes_out,
        "seconds": time.time() - t0,
    }


def _gate_up_amaxes(src: str, shards: dict[str, list[str]], targets: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Shared global amax of every gate/up pair (max over both), as fp32 values."""
    single: dict[str, float] = {}
    for shard, keys in shards.items():
        wanted = [k for k in keys if k in targets and pair_module(targets[k][0]) is not None]
        if not wanted:
            continue
        with safe_open(os.path.join(src, shard), "pt") as f:
            for name in wanted:
                t = f.get_tensor(name)
                check_weight(t, name)
                single[targets[name][0]] = float(nvfp4.amax(t))
    return {mod: max(a, single[pair_module(mod)]) for mod, a in single.items()}


def verify_conversion(src: str, out: str, opts: ConvertOptions | None = None) -> int:
    """Re-read out and check every tensor against src: quantized ones bit-identical to a fresh
    contract quantization (so dq equals the trainer's qdq), others unchanged. Returns the count."""
    opts = opts or ConvertOptions()
    shards = read_shards(src)
    targets = {n: c for keys in shards.values() for n in keys if (c := classify(n, opts)) is not None}
    amaxes = _gate_up_amaxes(src, shards, targets)
    with open(os.path.join(out, INDEX)) as f:
        out_map = json.load(f)["weight_map"]
    handles: dict[str, object] = {}

    def get(name: str) -> torch.Tensor:
        if name not in out_map:
            raise ConvertError(f"verify: {name} missing from {out}")
        shard = out_map[name]
        if shard not in handles:
            handles[shard] = safe_open(os.path.join(out, shard), "pt")
        return handles[shard].get_tensor(name)  # type: ignore[attr-defined]

    count = 0
    for shard, keys in shards.items():
        with safe_open(os.path.join(src, shard), "pt") as f:
            for name in keys:
                t = f.get_tensor(name)
                if name in targets:
                    mod = targets[name][0]
                    amax = amaxes.get(mod)
                    want = nvfp4.quantize(t, "tensor", torch.tensor(amax) if amax is not None else None)
                    got = nvfp4.from_modelopt(
                        get(f"{mod}.weight"), get(f"{mod}.weight_scale"), get(f"{mod}.weight_scale_2")
                    )
                    if not got.same_bits(want):
                        raise ConvertError(f"verify: {mod} differs from the contract quantization of {name}")
                elif not torch.equal(get(name), t):
                    raise ConvertError(f"verify: {name} differs from the source")
                count += 1
    return count
