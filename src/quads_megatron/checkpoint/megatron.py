"""Megatron-Core distributed checkpoint (torch_dist) -> NVFP4 ModelOpt layout, one layer at a time."""

from __future__ import annotations

import os
import re
import time

import torch
from safetensors import safe_open

from quads_megatron import __version__
from quads_megatron.checkpoint.calibration_inputs import MoELayer, check_calibration
from quads_megatron.checkpoint.hf import read_shards
from quads_megatron.checkpoint.live_sync import megatron_expert_tensors
from quads_megatron.checkpoint.modelopt import (
    ConvertOptions,
    classify,
    excluded_linears,
    fill_input_scales,
    read_model_config,
    write_quant_configs,
)
from quads_megatron.checkpoint.output import (
    ConversionOutput,
    Progress,
    copy_side_files,
    dir_fingerprint,
    same_tensor,
    source_fingerprint,
)
from quads_megatron.errors import ConvertError

_MCORE_DIST = re.compile(r"^(?P<pre>.*?)layers\.(?P<layer>\d+)\.mlp\.experts\.experts\.linear_(?P<fc>fc1|fc2)\.weight$")
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def convert_megatron_dist(
    src: str,
    dst: str,
    base_hf: str,
    opts: ConvertOptions | None = None,
    hf_prefix: str = "model.layers",
    layer_offset: int = 0,
    non_expert: str = "megatron",
) -> dict[str, object]:
    """Megatron-Core distributed checkpoint (torch_dist) -> NVFP4 ModelOpt layout at dst.

    Routed experts come from src, global [E, N, K] per layer (layer-stacked or per-layer keys, see
    quads_megatron.checkpoint.dist_reader), the same for any EP/TP/PP layout, so EP=1 and EP=N checkpoints
    convert to identical bytes; read one layer at a time and converted with megatron_expert_tensors
    (fc1 = gate|up with one shared amax). Non-expert weights: non_expert='megatron' maps them from
    src (quads_megatron.checkpoint.hf_mapping, Qwen2/Qwen3-MoE family; cast to base_hf's dtypes), 'hf' copies
    them from base_hf. base_hf (the HF checkpoint of the same model) always provides config.json,
    the tokenizer, and the names and shapes every output tensor is checked against. Atomic and
    resumable like convert_hf.
    """
    from quads_megatron.checkpoint.dist_reader import DistCheckpoint, DistCheckpointError
    from quads_megatron.checkpoint.hf_mapping import AttentionShape, MappingError, megatron_to_hf

    opts = opts or ConvertOptions()
    if non_expert not in ("megatron", "hf"):
        raise ConvertError(f"non_expert must be 'megatron' or 'hf', got {non_expert!r}")
    t0 = time.time()
    for path, what in ((src, "Megatron checkpoint"), (base_hf, "HF checkpoint (--megatron-base-hf)")):
        if not os.path.isdir(path):
            raise ConvertError(f"{path}: not a directory ({what})")
    out = ConversionOutput(dst, [src, base_hf, *opts.source_paths], opts.overwrite, opts.progress)
    try:
        ckpt = DistCheckpoint(src)
    except DistCheckpointError as e:
        raise ConvertError(str(e)) from e
    experts: dict[tuple[str, int], dict[str, object]] = {}
    others = []
    for t in ckpt.layer_tensors():
        m = _MCORE_DIST.match(t.name)
        if m is not None:
            experts.setdefault((m["pre"], int(m["layer"])), {})[m["fc"]] = t
        elif not t.name.endswith("_extra_state"):
            others.append(t)
    if not experts:
        sample = sorted(k for k in ckpt.tensors if ".experts." in k)[:3]
        raise ConvertError(
            f"{src}: no global expert tensors '...layers[.N].mlp.experts.experts.linear_fc1.weight' found "
            f"(unknown layout; expert keys seen: {sample or 'none'})"
        )
    moe: dict[str, MoELayer] = {}
    modules: set[str] = set()
    for (_, layer), fcs in experts.items():
        shapes = {}
        for fc in ("fc1", "fc2"):
            if fc not in fcs:
                raise ConvertError(f"{src}: layer {layer} has no linear_{fc} experts (half-written checkpoint?)")
            t = fcs[fc]
            shapes[fc] = ckpt.shape(t.key)[0 if t.layer is None else 1 :]
            if len(shapes[fc]) != 3:
                raise ConvertError(f"{src}: {t.key} has shape {ckpt.shape(t.key)}, expected [(L,) E, N, K]")
        prefix = f"{hf_prefix}.{layer + layer_offset}.mlp.experts"
        moe[prefix] = MoELayer(hidden=shapes["fc1"][-1], inter=shapes["fc2"][-1])
        modules |= {f"{prefix}.{e}.{p}" for e in range(shapes["fc1"][0]) for p in ("gate_proj", "up_proj", "down_proj")}
    check_calibration(opts, modules, moe)
    model_config = read_model_config(base_hf)
    base_shards = read_shards(base_hf, opts.progress)
    base_names = {n: shard for shard, keys in base_shards.items() for n in keys}
    handles: dict[str, object] = {}

    def base_slice(name: str):
        shard = base_names[name]
        if shard not in handles:
            handles[shard] = safe_open(os.path.join(base_hf, shard), "pt")
        return handles[shard].get_slice(name)  # type: ignore[attr-defined]

    def _map(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        try:
            return megatron_to_hf(name, t, attn, hf_prefix, layer_offset)
        except MappingError as e:
            raise ConvertError(
                f"{src}: {e}; pass non_expert='hf' (--non-expert-from hf) to take them from {base_hf}"
            ) from e

    def check_output(name: str, shape: list[int], what: str) -> None:
        if name not in base_names:
            raise ConvertError(f"{name}: {what} {src} but absent from {base_hf} (different model?)")
        want = list(base_slice(name).get_shape())
        if want != shape:
            raise ConvertError(f"{name}: {src} gives {shape}, {base_hf} has {want}")

    # every output name and shape is checked against base_hf before anything is written
    expert_weights: set[str] = set()
    for (_, layer), fcs in experts.items():
        (n_exp, rows, hidden), (_, hidden2, inter) = (ckpt.shape(fcs[fc].key)[-3:] for fc in ("fc1", "fc2"))
        if rows % 2:
            raise ConvertError(f"{src}: {fcs['fc1'].key} has an odd row count {rows}; expected gate|up halves")
        for e in range(n_exp):
            base = f"{hf_prefix}.{layer + layer_offset}.mlp.experts.{e}"
            for proj, shape in (("gate_proj", [rows // 2, hidden]), ("up_proj", [rows // 2, hidden])):
                check_output(f"{base}.{proj}.weight", shape, "converted from")
            check_output(f"{base}.down_proj.weight", [hidden2, inter], "converted from")
            expert_weights |= {f"{base}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    unconverted = sorted(n for n in base_names if n not in expert_weights and classify(n, ConvertOptions()))
    if unconverted:
        raise ConvertError(f"{base_hf} has expert weights that {src} does not: {unconverted[:3]}")
    attn = None  # needed only to split a fused QKV weight
    if non_expert == "megatron" and "num_attention_heads" in model_config:
        try:
            attn = AttentionShape.from_hf_config(model_config)
        except MappingError as e:
            raise ConvertError(f"{base_hf}/config.json: {e}") from e
    groups: dict[str, list] = {}
    mapped: set[str] = set()
    for t in others if non_expert == "megatron" else ():
        m = re.match(r"^.*?layers\.(\d+)\.", t.name)
        groups.setdefault(
            f"model-nonexpert-{int(m[1]):05d}.safetensors" if m else "model-nonexpert-global.safetensors", []
        ).append(t)
        shape = ckpt.shape(t.key)[0 if t.layer is None else 1 :]
        meta = torch.empty(shape, dtype=ckpt.tensors[t.key].properties.dtype, device="meta")
        for name, x in _map(t.name, meta):
            check_output(name, list(x.shape), "mapped from")
            mapped.add(name)
    missing = sorted(set(base_names) - expert_weights - mapped) if non_expert == "megatron" else []
    if missing:
        raise ConvertError(
            f"{src} has no tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''} of {base_hf}; "
            "pass non_expert='hf' (--non-expert-from hf) to take non-expert weights from the HF checkpoint"
        )

    def convert_layer(pre: str, layer: int) -> dict[str, torch.Tensor]:
        named = []
        for fc in ("fc1", "fc2"):
            t = ckpt.read(experts[(pre, layer)][fc])
            named += [
                (f"{pre}layers.{layer}.mlp.experts.local_experts.{e}.linear_{fc}.weight", t[e]) for e in range(len(t))
            ]
        return fill_input_scales(
            dict(
                megatron_expert_tensors(
                    named, 0, len(named) // 2, hf_prefix, layer_offset, opts.input_amax, opts.nvfp4
                )
            )
        )

    def map_group(shard: str) -> dict[str, torch.Tensor]:
        out = {}
        for t in groups[shard]:
            for name, x in _map(t.name, ckpt.read(t)):
                out[name] = x.to(_ST_DTYPES.get(base_slice(name).get_dtype(), x.dtype)).contiguous()
        return out

    fingerprint = {
        "source": dir_fingerprint(src),
        "base": source_fingerprint(base_hf, base_shards),
        "options": opts.fingerprint(),
        "layout": [hf_prefix, layer_offset, non_expert],
        "version": __version__,
    }
    names = list(base_names)
    targets = {n: (n[: -len(".weight")], "") for n in expert_weights}
    layers = sorted(experts)
    units = [
        (f"model-experts-{layer:05d}.safetensors", lambda p=pre, x=layer: convert_layer(p, x)) for pre, layer in layers
    ]
    if non_expert == "megatron":
        units += [(shard, lambda s=shard: map_group(s)) for shard in sorted(groups)]
    base_units = [f"model-base-{shard}" for shard in base_shards] if non_expert == "hf" else []
    with out.writing(fingerprint):
        out.resume([shard for shard, _ in units] + base_units)
        weight_map: dict[str, str] = {}
        progress = Progress("write", len(units) + len(base_units), opts.progress)
        for shard, make in units:
            if out.done_keys(shard) is None:
                out.write_shard(shard, make())
            weight_map.update({k: shard for k in out.done_keys(shard) or []})
            progress.step(shard)
        if non_expert == "hf":
            for shard, keys in base_shards.items():
                out_shard = f"model-base-{shard}"
                rest = [k for k in keys if k not in targets]
                if rest and out.done_keys(out_shard) is None:
                    with safe_open(os.path.join(base_hf, shard), "pt") as f:
                        out.write_shard(out_shard, {k: f.get_tensor(k) for k in rest})
                weight_map.update({k: out_shard for k in out.done_keys(out_shard) or []})
                progress.step(out_shard)
        out.write_index(weight_map)
        exclude = sorted(excluded_linears(names, targets))
        write_quant_configs(
            model_config, out.partial, exclude, opts.quads_block(), bool(opts.input_amax), opts.nvfp4
        )
        copy_side_files(base_hf, out.partial)

        def verify() -> None:  # re-read what was written against a fresh conversion (or base, for copied tensors)
            bar = Progress("verify", len(units) + len(base_units), opts.progress)
            for shard, make in units:
                with safe_open(os.path.join(out.partial, shard), "pt") as f:
                    for name, want in make().items():
                        if not same_tensor(f.get_tensor(name), want):
                            raise ConvertError(f"verify: {name} in {shard} differs from a fresh conversion of {src}")
                bar.step(shard)
            for shard, keys in base_shards.items() if non_expert == "hf" else ():
                with safe_open(os.path.join(base_hf, shard), "pt") as f:
                    for k in keys:
                        if k not in targets:
                            with safe_open(os.path.join(out.partial, weight_map[k]), "pt") as g:
                                if not same_tensor(g.get_tensor(k), f.get_tensor(k)):
                                    raise ConvertError(f"verify: {k} differs from {base_hf}")
                bar.step(shard)

        out.verify(verify, opts.verify)
        out.publish()
    return {"quantized_modules": len(modules), "layers": len(layers), "seconds": time.time() - t0}
