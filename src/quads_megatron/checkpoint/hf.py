"""HF safetensors checkpoint (BF16) -> NVFP4 ModelOpt layout, streaming, atomic and resumable.

One source shard at a time (plus a first pass that reads gate/up amaxes); output is written through
checkpoint.output.ConversionOutput: ``<dst>.partial`` with a state file (resumable), then renamed
to ``<dst>``.
"""

from __future__ import annotations

import json
import os
import time

import torch
from safetensors import safe_open

from quads_megatron import __version__, nvfp4
from quads_megatron.checkpoint.calibration_inputs import MoELayer, check_calibration
from quads_megatron.checkpoint.modelopt import (
    INDEX,
    UNCALIBRATED_INPUT_SCALE,
    ConvertOptions,
    check_weight,
    classify,
    excluded_linears,
    fill_input_scales,
    modelopt_tensors,
    pair_module,
    quantize_linear,
    read_model_config,
    routed_moe_gemm,
    write_quant_configs,
)
from quads_megatron.checkpoint.output import (
    ConversionOutput,
    Progress,
    copy_side_files,
    same_tensor,
    source_fingerprint,
)
from quads_megatron.errors import ConvertError


def _check_shard_name(src: str, shard: object) -> str:
    """A shard named by an index must be a plain .safetensors file name inside the checkpoint (it is
    also the name written in the output)."""
    if (
        not isinstance(shard, str)
        or not shard.endswith(".safetensors")
        or shard != os.path.basename(shard)
        or shard.startswith(".")
        or "\\" in shard
    ):
        raise ConvertError(f"{src}: the index names shard {shard!r}; expected a plain <name>.safetensors file name")
    return shard


def read_shards(src: str, progress: bool = False) -> dict[str, list[str]]:
    """shard file -> parameter names, from the index (or the single model.safetensors)."""
    index_path = os.path.join(src, INDEX)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            items = list(weight_map.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConvertError(f"{index_path}: unreadable safetensors index ({e})") from e
        shards: dict[str, list[str]] = {}
        for name, shard in items:
            shards.setdefault(_check_shard_name(src, shard), []).append(name)
    else:
        files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
        if len(files) != 1:
            raise ConvertError(f"{src}: no {INDEX} and {len(files)} .safetensors files (expected exactly one)")
        shards = {files[0]: []}
    scan = Progress("scan", len(shards), progress)
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
        scan.step(shard)
    return shards


def moe_layers(shapes: dict[str, list[int]]) -> dict[str, MoELayer]:
    """Routed MoE layers (FusedMoE prefixes) and their GEMMs' K, from the [N, K] shapes of quantized modules."""
    ks: dict[str, dict[str, set[int]]] = {}
    for mod, shape in shapes.items():
        routed = routed_moe_gemm(mod)
        if routed is not None:
            ks.setdefault(routed[0], {"w13": set(), "w2": set()})[routed[1]].add(int(shape[-1]))
    layers = {}
    for prefix, k in ks.items():
        if len(k["w13"]) > 1 or len(k["w2"]) > 1:
            raise ConvertError(f"{prefix}: experts disagree on K (w13 K {sorted(k['w13'])}, w2 K {sorted(k['w2'])})")
        layers[prefix] = MoELayer(hidden=min(k["w13"], default=None), inter=min(k["w2"], default=None))
    return layers


def _target_shapes(src: str, shards: dict[str, list[str]], targets: dict[str, tuple[str, str]]) -> dict[str, list[int]]:
    """[N, K] of every target weight, from the shard headers; refuses shapes NVFP4 cannot take."""
    shapes = {}
    for shard, keys in shards.items():
        wanted = [k for k in keys if k in targets]
        if wanted:
            with safe_open(os.path.join(src, shard), "pt") as f:
                shapes.update({k: list(f.get_slice(k).get_shape()) for k in wanted})
    for name, shape in shapes.items():
        if len(shape) != 2:
            raise ConvertError(f"{name}: expected a 2-D [N, K] weight, got shape {tuple(shape)}")
        if shape[1] == 0 or shape[1] % nvfp4.BLOCK_SIZE:
            raise ConvertError(
                f"{name}: last dimension K={shape[1]} must be a positive multiple of {nvfp4.BLOCK_SIZE} "
                f"(NVFP4 1x{nvfp4.BLOCK_SIZE} blocks along K); shape {tuple(shape)}"
            )
    return {targets[k][0]: v for k, v in shapes.items()}


def _plan(src: str, opts: ConvertOptions) -> tuple[dict, list[str], dict, dict[str, float]]:
    """Scan src and check every input: (shards, names, targets, input amaxes). Writes nothing."""
    shards = read_shards(src, opts.progress)
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
    amax = check_calibration(opts, modules, moe_layers(_target_shapes(src, shards, targets)))
    return shards, names, targets, amax


def convert_hf(src: str, dst: str, opts: ConvertOptions | None = None) -> dict[str, object]:
    """Convert an HF safetensors checkpoint directory to NVFP4 ModelOpt layout at dst.

    Returns a summary (quantized modules, bytes in/out, seconds). Raises ConvertError on bad input:
    paths, names, shapes, configs and calibration inputs are checked before anything is written;
    non-finite weights are found while streaming them (the partial output is kept). dst is only
    created, by an atomic rename, once everything was written (and verified, with opts.verify or
    after a failed verification of an earlier run).
    """
    opts = opts or ConvertOptions()
    t0 = time.time()
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: not a directory")
    out = ConversionOutput(dst, [src, *opts.source_paths], opts.overwrite, opts.progress)
    shards, names, targets, input_amax = _plan(src, opts)
    model_config = read_model_config(src)
    modules = {mod for mod, _ in targets.values()}
    fingerprint = {"source": source_fingerprint(src, shards), "options": opts.fingerprint(), "version": __version__}
    bytes_in = bytes_out = 0
    with out.writing(fingerprint):
        if "amax" not in out.state:
            out.state["amax"] = _gate_up_amaxes(src, shards, targets, opts.progress)
            out.save_state()
        amaxes = out.state["amax"]
        out.resume(list(shards))
        progress = Progress("write", len(shards), opts.progress)
        weight_map: dict[str, str] = {}
        for shard, keys in shards.items():
            out_keys = out.done_keys(shard)
            if out_keys is None:
                tensors: dict[str, torch.Tensor] = {}
                with safe_open(os.path.join(src, shard), "pt") as f:
                    for name in keys:
                        t = f.get_tensor(name)
                        bytes_in += t.numel() * t.element_size()
                        if name in targets:
                            mod, _ = targets[name]
                            amax = amaxes.get(mod)
                            g = torch.tensor(amax) if amax is not None else None
                            q = quantize_linear(t, name, g, opts.nvfp4.weights)
                            tensors.update(modelopt_tensors(mod, q, input_amax.get(mod), opts.nvfp4.activations))
                        else:
                            tensors[name] = t
                fill_input_scales(tensors)
                out.write_shard(shard, tensors)
                bytes_out += sum(v.numel() * v.element_size() for v in tensors.values())
                out_keys = sorted(tensors)
            weight_map.update({k: shard for k in out_keys})
            progress.step(shard)
        out.write_index(weight_map)
        exclude = sorted(excluded_linears(names, targets))
        write_quant_configs(
            model_config, out.partial, exclude, opts.quads_block(), bool(opts.input_amax), opts.nvfp4
        )
        copy_side_files(src, out.partial)
        out.verify(lambda: verify_conversion(src, out.partial, opts), opts.verify)
        out.publish()
    return {
        "quantized_modules": len(modules),
        "shards": len(shards),
        "bytes_in_this_run": bytes_in,
        "bytes_out_this_run": bytes_out,
        "seconds": time.time() - t0,
    }


def _gate_up_amaxes(
    src: str, shards: dict[str, list[str]], targets: dict[str, tuple[str, str]], progress: bool = False
) -> dict[str, float]:
    """Shared global amax of every gate/up pair (max over both), as fp32 values."""
    single: dict[str, float] = {}
    todo = {
        s: [k for k in keys if k in targets and pair_module(targets[k][0]) is not None] for s, keys in shards.items()
    }
    todo = {s: w for s, w in todo.items() if w}
    bar = Progress("amax", len(todo), progress)
    for shard, wanted in todo.items():
        with safe_open(os.path.join(src, shard), "pt") as f:
            for name in wanted:
                t = f.get_tensor(name)
                check_weight(t, name)
                single[targets[name][0]] = float(nvfp4.amax(t))
        bar.step(shard)
    return {mod: max(a, single[pair_module(mod)]) for mod, a in single.items()}


def verify_conversion(src: str, out: str, opts: ConvertOptions | None = None) -> int:
    """Re-read out and check every tensor against src: quantized ones bit-identical to a fresh
    contract quantization under opts.nvfp4 (so dq equals the trainer's qdq) with the input_scale opts gives (or the
    uncalibrated default), others byte-identical with the same dtype and shape; nothing else in out.
    Returns the number of source tensors checked."""
    opts = opts or ConvertOptions()
    shards = read_shards(src)
    targets = {n: c for keys in shards.values() for n in keys if (c := classify(n, opts)) is not None}
    amaxes = _gate_up_amaxes(src, shards, targets)
    try:
        with open(os.path.join(out, INDEX)) as f:
            out_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        raise ConvertError(f"verify: {out}: no readable {INDEX} ({e})") from e
    handles: dict[str, object] = {}

    def get(name: str) -> torch.Tensor:
        if name not in out_map:
            raise ConvertError(f"verify: {name} missing from {out}")
        shard = _check_shard_name(out, out_map[name])
        if shard not in handles:
            try:
                handles[shard] = safe_open(os.path.join(out, shard), "pt")
            except Exception as e:  # safetensors raises its own error types
                raise ConvertError(f"verify: {out}/{shard}: not a readable safetensors file ({e})") from e
        return handles[shard].get_tensor(name)  # type: ignore[attr-defined]

    count = 0
    expected: set[str] = set()
    bar = Progress("verify", len(shards), opts.progress)
    for shard, keys in shards.items():
        with safe_open(os.path.join(src, shard), "pt") as f:
            for name in keys:
                t = f.get_tensor(name)
                if name in targets:
                    mod = targets[name][0]
                    amax = amaxes.get(mod)
                    g = torch.tensor(amax) if amax is not None else None
                    want = nvfp4.quantize(t, "tensor", g, recipe=opts.nvfp4.weights)
                    got = nvfp4.from_modelopt(
                        get(f"{mod}.weight"), get(f"{mod}.weight_scale"), get(f"{mod}.weight_scale_2")
                    )
                    if not got.same_bits(want):
                        raise ConvertError(f"verify: {mod} differs from the contract quantization of {name}")
                    a = opts.input_amax.get(mod)
                    scale = (
                        nvfp4.input_scale_from_amax(torch.tensor(float(a)), opts.nvfp4.activations)
                        if a is not None
                        else torch.tensor(UNCALIBRATED_INPUT_SCALE, dtype=torch.float32)
                    )
                    if not same_tensor(get(f"{mod}.input_scale"), scale):
                        raise ConvertError(
                            f"verify: {mod}.input_scale is not {float(scale)} (converted with other --input-amax?)"
                        )
                    expected.update(f"{mod}.{k}" for k in ("weight", "weight_scale", "weight_scale_2", "input_scale"))
                elif not same_tensor(get(name), t):
                    raise ConvertError(f"verify: {name} differs from the source (bytes, dtype or shape)")
                else:
                    expected.add(name)
                count += 1
        bar.step(shard)
    extra = sorted(set(out_map) - expected)
    if extra:
        raise ConvertError(f"verify: {out} holds tensors the source does not give: {extra[:3]}")
    return count
