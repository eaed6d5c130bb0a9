"""Megatron-Core distributed checkpoint (torch_dist) -> NVFP4 ModelOpt layout, one layer at a time."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quads_megatron import __version__
from quads_megatron.checkpoint.hf import read_shards
from quads_megatron.checkpoint.live_sync import megatron_expert_tensors
from quads_megatron.checkpoint.modelopt import INDEX, ConvertOptions, excluded_linears, write_quant_configs
from quads_megatron.checkpoint.output import (
    STATE,
    Progress,
    copy_side_files,
    dir_fingerprint,
    load_state,
    save_state,
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
    if os.path.exists(dst) and not opts.overwrite:
        raise ConvertError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
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
    for (_, layer), fcs in experts.items():
        for fc in ("fc1", "fc2"):
            if fc not in fcs:
                raise ConvertError(f"{src}: layer {layer} has no linear_{fc} experts (half-written checkpoint?)")
            t = fcs[fc]
            shape = ckpt.shape(t.key)[0 if t.layer is None else 1 :]
            if len(shape) != 3:
                raise ConvertError(f"{src}: {t.key} has shape {ckpt.shape(t.key)}, expected [(L,) E, N, K]")
    base_shards = read_shards(base_hf)
    base_names = {n: shard for shard, keys in base_shards.items() for n in keys}
    handles: dict[str, object] = {}

    def base_slice(name: str):
        shard = base_names[name]
        if shard not in handles:
            handles[shard] = safe_open(os.path.join(base_hf, shard), "pt")
        return handles[shard].get_slice(name)  # type: ignore[attr-defined]

    def convert_layer(pre: str, layer: int) -> dict[str, torch.Tensor]:
        named = []
        for fc in ("fc1", "fc2"):
            t = ckpt.read(experts[(pre, layer)][fc])
            named += [
                (f"{pre}layers.{layer}.mlp.experts.local_experts.{e}.linear_{fc}.weight", t[e]) for e in range(len(t))
            ]
        out = dict(megatron_expert_tensors(named, 0, len(named) // 2, hf_prefix, layer_offset, opts.input_amax))
        for name, t in out.items():
            if not name.endswith(".weight"):
                continue
            if name not in base_names:
                raise ConvertError(f"{name}: converted from {src} but absent from {base_hf} (different model?)")
            shape = list(base_slice(name).get_shape())
            if shape != [t.shape[0], t.shape[1] * 2]:
                raise ConvertError(f"{name}: {src} gives [N, K]={[t.shape[0], t.shape[1] * 2]}, {base_hf} has {shape}")
        return out

    attn = None  # needed only to split a fused QKV weight
    if non_expert == "megatron":
        with open(os.path.join(base_hf, "config.json")) as f:
            hf_config = json.load(f)
        if "num_attention_heads" in hf_config:
            try:
                attn = AttentionShape.from_hf_config(hf_config)
            except MappingError as e:
                raise ConvertError(f"{base_hf}/config.json: {e}") from e
    groups: dict[str, list] = {}
    for t in others:
        m = re.match(r"^.*?layers\.(\d+)\.", t.name)
        groups.setdefault(
            f"model-nonexpert-{int(m[1]):05d}.safetensors" if m else "model-nonexpert-global.safetensors", []
        ).append(t)

    def map_group(shard: str) -> dict[str, torch.Tensor]:
        out = {}
        for t in groups[shard]:
            try:
                pairs = megatron_to_hf(t.name, ckpt.read(t), attn, hf_prefix, layer_offset)
            except MappingError as e:
                raise ConvertError(
                    f"{src}: {e}; pass non_expert='hf' (--non-expert-from hf) to take them from {base_hf}"
                ) from e
            for name, x in pairs:
                if name not in base_names:
                    raise ConvertError(f"{name}: mapped from {src} but absent from {base_hf} (different model?)")
                sl = base_slice(name)
                if list(sl.get_shape()) != list(x.shape):
                    raise ConvertError(f"{name}: {src} gives {list(x.shape)}, {base_hf} has {list(sl.get_shape())}")
                out[name] = x.to(_ST_DTYPES.get(sl.get_dtype(), x.dtype)).contiguous()
        return out

    partial = dst.rstrip("/") + ".partial"
    fingerprint = {
        "source": dir_fingerprint(src),
        "base": source_fingerprint(base_hf, base_shards),
        "options": opts.fingerprint(),
        "layout": [hf_prefix, layer_offset, non_expert],
        "version": __version__,
    }
    state = load_state(partial, fingerprint)
    done = state.setdefault("done", {})
    weight_map: dict[str, str] = {}
    layers = sorted(experts)
    units = [
        (f"model-experts-{layer:05d}.safetensors", lambda p=pre, x=layer: convert_layer(p, x)) for pre, layer in layers
    ]
    if non_expert == "megatron":
        units += [(shard, lambda s=shard: map_group(s)) for shard in sorted(groups)]
    progress = Progress(len(units) + (len(base_shards) if non_expert == "hf" else 0), opts.progress)
    for shard, make in units:
        if shard not in done:
            out = make()
            save_file(out, os.path.join(partial, shard), metadata={"format": "pt"})
            done[shard] = sorted(out)
            save_state(partial, state)
        weight_map.update({k: shard for k in done[shard]})
        progress.step(shard)
    experts_out = {k[: -len(".weight")] for s, _ in units[: len(layers)] for k in done[s] if k.endswith(".weight")}
    names = list(base_names)
    targets = {
        n: (n[: -len(".weight")], "") for n in names if n.endswith(".weight") and n[: -len(".weight")] in experts_out
    }
    if non_expert == "hf":
        for shard, keys in base_shards.items():
            out_shard = f"model-base-{shard}"
            rest = [k for k in keys if k not in targets]
            if rest and out_shard not in done:
                with safe_open(os.path.join(base_hf, shard), "pt") as f:
                    kept = {k: f.get_tensor(k) for k in rest}
                save_file(kept, os.path.join(partial, out_shard), metadata={"format": "pt"})
                done[out_shard] = sorted(kept)
                save_state(partial, state)
            weight_map.update({k: out_shard for k in done.get(out_shard, [])})
            progress.step(shard)
    missing = sorted(set(base_names) - set(weight_map) - set(targets))
    if missing:
        raise ConvertError(
            f"{src} has no tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''} of {base_hf}; "
            "pass non_expert='hf' (--non-expert-from hf) to take non-expert weights from the HF checkpoint"
        )
    with open(os.path.join(partial, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    write_quant_configs(base_hf, partial, sorted(excluded_linears(names, targets)), opts.quads)
    copy_side_files(base_hf, partial)
    if opts.verify:  # re-read what was written against a fresh conversion (or base, for copied tensors)
        for shard, make in units:
            with safe_open(os.path.join(partial, shard), "pt") as f:
                for name, want in make().items():
                    if not torch.equal(f.get_tensor(name).view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
                        raise ConvertError(f"verify: {name} in {shard} differs from a fresh conversion of {src}")
        if non_expert == "hf":
            for shard, keys in base_shards.items():
                with safe_open(os.path.join(base_hf, shard), "pt") as f:
                    for k in keys:
                        if k not in targets:
                            with safe_open(os.path.join(partial, weight_map[k]), "pt") as g:
                                if not torch.equal(g.get_tensor(k), f.get_tensor(k)):
                                    raise ConvertError(f"verify: {k} differs from {base_hf}")
    os.remove(os.path.join(partial, STATE))
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.rename(partial, dst)
    return {"quantized_modules": len(experts_out), "layers": len(layers), "seconds": time.time() - t0}
