"""Checkpoint conversion to NVFP4 (ModelOpt layout) with the trainer's exact scales.

Offline: HF safetensors (BF16) -> NVFP4 ModelOpt layout that stock SGLang/vLLM modelopt loaders
read: per quantized linear ``weight`` (uint8 [N, K/2]), ``weight_scale`` (float8_e4m3fn
[N, K/16]), ``weight_scale_2`` (fp32 scalar), ``input_scale`` (fp32, only from calibration),
plus hf_quant_config.json and config.json ``quantization_config``. Experts only by default;
gate/up (w1/w3) of one expert share one global amax, which is what the trainer's fused fc1
per-tensor scale is, so dq(converted) == trainer qdq(W) bit for bit.

Streaming: one source shard at a time (plus a first pass that reads gate/up amaxes); output is
written to ``<dst>.partial`` with a state file (resumable), then renamed to ``<dst>`` (atomic).

Live sync: megatron_expert_tensors() turns Megatron expert params (SequentialMLP or
TEGroupedMLP names, any EP rank) into the same HF-named NVFP4 tensors, bucketed.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quads_megatron import __version__, nvfp4

INDEX = "model.safetensors.index.json"
STATE = "quads_convert_state.json"

# expert projection names: (regex on the parameter name, role)
_EXPERT_RE = [
    re.compile(r"^(?P<mod>(?P<expert>.*\.experts\.(?P<idx>\d+))\.(?P<proj>gate_proj|up_proj|down_proj))\.weight$"),
    re.compile(r"^(?P<mod>(?P<expert>.*\.block_sparse_moe\.experts\.(?P<idx>\d+))\.(?P<proj>w1|w3|w2))\.weight$"),
]
_SHARED_RE = re.compile(r"^(?P<mod>(?P<expert>.*\.shared_experts?)\.(?P<proj>gate_proj|up_proj|down_proj))\.weight$")
_GATE_UP = {"gate_proj": "up_proj", "up_proj": "gate_proj", "w1": "w3", "w3": "w1"}


class ConvertError(ValueError):
    """The source checkpoint cannot be converted; nothing is written to the destination."""


@dataclass(frozen=True)
class ConvertOptions:
    include_shared_experts: bool = False
    exclude: tuple[str, ...] = ()  # glob patterns on module names (without .weight)
    input_amax: dict[str, float] = field(default_factory=dict)  # module -> calibrated activation amax
    overwrite: bool = False
    verify: bool = False
    progress: bool = True
    # QUADS rollout extras written into the quantization configs (read by the SGLang quads_nvfp4
    # method, ignored by stock ModelOpt loaders): {"rollout": {...}, "rac_plans": {prefix: {w13, w2}}}
    quads: dict = field(default_factory=dict)

    def fingerprint(self) -> str:
        """Hash of the options that shape the output (resuming needs the same ones)."""
        shaping = {k: v for k, v in asdict(self).items() if k in ("include_shared_experts", "exclude", "input_amax")}
        return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:16]


def classify(name: str, opts: ConvertOptions) -> tuple[str, str] | None:
    """(module, expert key) if the parameter is an NVFP4 target under opts, else None."""
    for rx in _EXPERT_RE:
        m = rx.match(name)
        if m:
            break
    else:
        m = _SHARED_RE.match(name) if opts.include_shared_experts else None
    if m is None or any(fnmatch.fnmatchcase(m["mod"], p) for p in opts.exclude):
        return None
    return m["mod"], m["expert"]


def pair_module(module: str) -> str | None:
    """The gate<->up partner of a gate/up (w1/w3) module name, else None."""
    head, _, proj = module.rpartition(".")
    return f"{head}.{_GATE_UP[proj]}" if proj in _GATE_UP else None


def _check_weight(weight: torch.Tensor, name: str) -> None:
    if weight.dim() != 2:
        raise ConvertError(f"{name}: expected a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
    try:
        nvfp4.check_quantizable(weight, name)
    except nvfp4.NVFP4InputError as e:
        raise ConvertError(str(e)) from e


def quantize_linear(weight: torch.Tensor, name: str, global_amax: torch.Tensor | None = None) -> nvfp4.NVFP4Tensor:
    """Contract quantization of one [N, K] linear weight with a readable error on bad input."""
    _check_weight(weight, name)
    return nvfp4.quantize(weight, "tensor", global_amax, check=False)


def modelopt_tensors(module: str, q: nvfp4.NVFP4Tensor, input_amax: float | None) -> dict[str, torch.Tensor]:
    out = {f"{module}.{k}": v.contiguous() for k, v in nvfp4.to_modelopt(q).items()}
    if input_amax is not None:
        out[f"{module}.input_scale"] = nvfp4.input_scale_from_amax(torch.tensor(float(input_amax)))
    return out


# ----------------------------------------------------------------------------- HF checkpoints


def _shards(src: str) -> dict[str, list[str]]:
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


def _source_fingerprint(src: str, shards: dict[str, list[str]]) -> str:
    h = hashlib.sha256()
    for shard in sorted(shards):
        st = os.stat(os.path.join(src, shard))
        h.update(f"{shard}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _dir_fingerprint(path: str) -> str:
    """Names, sizes and mtimes of the files in a checkpoint directory."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        st = os.stat(os.path.join(path, name))
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.time()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            fill = int(width * self.done / max(self.total, 1))
            sys.stderr.write(
                f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {label[-40:]:<40} "
                f"{time.time() - self.t0:6.1f}s"
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


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
    shards = _shards(src)
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
    fingerprint = {"source": _source_fingerprint(src, shards), "options": opts.fingerprint(), "version": __version__}
    state = _load_state(partial, fingerprint)

    amaxes = state.get("amax") or _gate_up_amaxes(src, shards, targets)
    state["amax"] = amaxes
    progress = _Progress(len(shards), opts.progress)
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
            _save_state(partial, state)
        weight_map.update({k: shard for k in out_keys})
        progress.step(shard)

    with open(os.path.join(partial, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": bytes_out}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    exclude = sorted(_excluded_linears(names, targets))
    _write_quant_configs(src, partial, exclude, opts.quads)
    _copy_side_files(src, partial)
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


def _load_state(partial: str, fingerprint: dict) -> dict:
    path = os.path.join(partial, STATE)
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
        if state.get("fingerprint") == fingerprint:
            return state  # resume
        shutil.rmtree(partial)  # a leftover of another source or other options: start over
    elif os.path.exists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)
    state = {"fingerprint": fingerprint}
    _save_state(partial, state)
    return state


def _save_state(partial: str, state: dict) -> None:
    tmp = os.path.join(partial, STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, os.path.join(partial, STATE))


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
                _check_weight(t, name)
                single[targets[name][0]] = float(nvfp4.amax(t))
    return {mod: max(a, single[pair_module(mod)]) for mod, a in single.items()}


def _excluded_linears(names: list[str], targets: dict[str, tuple[str, str]]) -> set[str]:
    return {n[: -len(".weight")] for n in names if n.endswith(".weight") and n not in targets}


def _write_quant_configs(src: str, dst: str, exclude: list[str], quads: dict | None = None) -> None:
    producer = {"name": "quads_megatron", "version": __version__}
    hf_quant = {
        "producer": producer,
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": exclude,
        },
    }
    if quads:
        hf_quant["quads"] = quads
    with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
        json.dump(hf_quant, f, indent=1)
    cfg_path = os.path.join(src, "config.json")
    config = {}
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "ignore": exclude,
        "producer": producer,
    }
    if quads:
        config["quantization_config"]["quads"] = quads
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def quads_extras(rollout: dict | None = None, rac_plans_file: str | None = None) -> dict:
    """The ``quads`` block of the quantization configs: rollout settings (validated like the trainer's
    YAML) and RAC plans from a safetensors file of int64 block indices named ``<moe prefix>.w13`` /
    ``<moe prefix>.w2`` (e.g. ``model.layers.0.mlp.experts.w13``; see w4a4.RACCalibrator)."""
    from quads_megatron.config import QuadsConfigError, load_config

    out: dict = {}
    if rollout:
        try:
            out["rollout"] = load_config({"rollout": rollout}).to_dict()["rollout"]
        except QuadsConfigError as e:
            raise ConvertError(f"quads rollout settings: {e}") from e
    if rac_plans_file:
        plans: dict[str, dict[str, list[int]]] = {}
        for name, t in load_file(rac_plans_file).items():
            prefix, _, gemm = name.rpartition(".")
            if gemm not in ("w13", "w2") or t.dim() != 1 or t.is_floating_point():
                raise ConvertError(f"{rac_plans_file}: {name} is not an int block list named <moe prefix>.w13|w2")
            plans.setdefault(prefix, {})[gemm] = sorted(int(i) for i in t.tolist())
        incomplete = sorted(p for p, g in plans.items() if set(g) != {"w13", "w2"})
        if incomplete:
            raise ConvertError(f"{rac_plans_file}: layers without both w13 and w2 plans: {incomplete[:4]}")
        out["rac_plans"] = plans
    return out


def _copy_side_files(src: str, dst: str) -> None:
    for name in os.listdir(src):
        if name.endswith(".safetensors") or name in (INDEX, "config.json", "hf_quant_config.json"):
            continue
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst, name))


def verify_conversion(src: str, out: str, opts: ConvertOptions | None = None) -> int:
    """Re-read out and check every tensor against src: quantized ones bit-identical to a fresh
    contract quantization (so dq equals the trainer's qdq), others unchanged. Returns the count."""
    opts = opts or ConvertOptions()
    shards = _shards(src)
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


# ----------------------------------------------------------------------------- Megatron dist checkpoints


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
    quads_megatron.megatron_dist), the same for any EP/TP/PP layout, so EP=1 and EP=N checkpoints
    convert to identical bytes; read one layer at a time and converted with megatron_expert_tensors
    (fc1 = gate|up with one shared amax). Non-expert weights: non_expert='megatron' maps them from
    src (quads_megatron.hf_mapping, Qwen2/Qwen3-MoE family; cast to base_hf's dtypes), 'hf' copies
    them from base_hf. base_hf (the HF checkpoint of the same model) always provides config.json,
    the tokenizer, and the names and shapes every output tensor is checked against. Atomic and
    resumable like convert_hf.
    """
    from quads_megatron.hf_mapping import AttentionShape, MappingError, megatron_to_hf
    from quads_megatron.megatron_dist import DistCheckpoint, DistCheckpointError

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
    base_shards = _shards(base_hf)
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
        "source": _dir_fingerprint(src),
        "base": _source_fingerprint(base_hf, base_shards),
        "options": opts.fingerprint(),
        "layout": [hf_prefix, layer_offset, non_expert],
        "version": __version__,
    }
    state = _load_state(partial, fingerprint)
    done = state.setdefault("done", {})
    weight_map: dict[str, str] = {}
    layers = sorted(experts)
    units = [
        (f"model-experts-{layer:05d}.safetensors", lambda p=pre, x=layer: convert_layer(p, x)) for pre, layer in layers
    ]
    if non_expert == "megatron":
        units += [(shard, lambda s=shard: map_group(s)) for shard in sorted(groups)]
    progress = _Progress(len(units) + (len(base_shards) if non_expert == "hf" else 0), opts.progress)
    for shard, make in units:
        if shard not in done:
            out = make()
            save_file(out, os.path.join(partial, shard), metadata={"format": "pt"})
            done[shard] = sorted(out)
            _save_state(partial, state)
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
                _save_state(partial, state)
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
    _write_quant_configs(base_hf, partial, sorted(_excluded_linears(names, targets)), opts.quads)
    _copy_side_files(base_hf, partial)
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


# ----------------------------------------------------------------------------- live sync


_MCORE_SEQ = re.compile(
    r"^(?P<pre>.*?)layers\.(?P<layer>\d+)\.mlp\.experts\.local_experts\.(?P<i>\d+)\.linear_(?P<fc>fc1|fc2)\.weight$"
)
_MCORE_TE = re.compile(r"^(?P<pre>.*?)layers\.(?P<layer>\d+)\.mlp\.experts\.linear_(?P<fc>fc1|fc2)\.weight(?P<i>\d+)$")


def megatron_expert_tensors(
    named_params: Iterable[tuple[str, torch.Tensor]],
    ep_rank: int = 0,
    num_local_experts: int | None = None,
    hf_prefix: str = "model.layers",
    layer_offset: int = 0,
    input_amax: dict[str, float] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron routed-expert params of one EP rank -> HF-named NVFP4 ModelOpt tensors.

    fc1 [2F, H] (gate | up, GLU) is quantized as one tensor (its amax is the shared gate/up
    amax) and split by rows into gate_proj / up_proj; fc2 -> down_proj. Global expert index =
    ep_rank * num_local_experts + local index. Non-expert params are skipped (send them as BF16).
    With expert TP > 1, pass the params through gather_expert_tp first (full [2F, H] / [H, F]).
    """
    input_amax = input_amax or {}
    for name, w in named_params:
        m = _MCORE_SEQ.match(name) or _MCORE_TE.match(name)
        if m is None:
            continue
        if num_local_experts is None:
            raise ConvertError("num_local_experts is required to map local experts to global indices")
        g = ep_rank * num_local_experts + int(m["i"])
        base = f"{hf_prefix}.{int(m['layer']) + layer_offset}.mlp.experts.{g}"
        q = quantize_linear(w, name)
        if m["fc"] == "fc2":
            yield from modelopt_tensors(f"{base}.down_proj", q, input_amax.get(f"{base}.down_proj")).items()
            continue
        if q.codes.shape[0] % 2:
            raise ConvertError(f"{name}: fc1 has an odd row count {q.codes.shape[0]}; expected gate|up halves")
        half = q.codes.shape[0] // 2
        for proj, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
            # own storage per tensor: receivers (and safetensors) must not see gate/up aliasing
            part = nvfp4.NVFP4Tensor(q.codes[rows].clone(), q.block_scales[rows].clone(), q.global_decode.clone())
            yield from modelopt_tensors(f"{base}.{proj}", part, input_amax.get(f"{base}.{proj}")).items()


def gather_expert_tp(
    named_params: Iterable[tuple[str, torch.Tensor]], group: object = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert-tensor-parallel shards -> full per-expert weights, for megatron_expert_tensors.

    Megatron's fc1 shard on ETP rank r is [gate_r; up_r] (F/ETP rows each; see megatron-core's
    apply_swiglu_sharded_factory), fc2 is columns r of [H, F]. Collective over ``group`` (the
    expert-TP group): every rank passes the same names in the same order. Other params and a
    group of one pass through unchanged.
    """
    size = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
    for name, t in named_params:
        m = _MCORE_SEQ.match(name) or _MCORE_TE.match(name)
        if m is None or size == 1:
            yield name, t
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        if m["fc"] == "fc1":
            if t.shape[0] % 2:
                raise ConvertError(f"{name}: expert-TP fc1 shard has an odd row count {t.shape[0]}")
            halves = [p.chunk(2, dim=0) for p in parts]
            yield name, torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            yield name, torch.cat(parts, dim=1)


_GATE_UP_UNIT = re.compile(r"^(?P<base>.*\.experts\.\d+)\.(?:gate_proj|up_proj|w1|w3)\.")


def bucketed(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20) -> Iterator[list]:
    """Group (name, tensor) pairs into lists of at most bucket_bytes.

    An expert's gate and up tensors (one shared global scale) always land in the same list, as
    long as they arrive consecutively (megatron_expert_tensors yields them so): a receiver can
    then check and apply each list on its own. One unit larger than bucket_bytes is a list alone.
    """
    unit: list[tuple[str, torch.Tensor]] = []
    unit_key = None
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0

    def nbytes(items):
        return sum(t.numel() * t.element_size() for _, t in items)

    for name, t in tensors:
        m = _GATE_UP_UNIT.match(name)
        key = m["base"] if m else None
        if unit and (key is None or key != unit_key):
            if bucket and size + nbytes(unit) > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket += unit
            size += nbytes(unit)
            unit = []
        unit.append((name, t))
        unit_key = key
    if unit:
        if bucket and size + nbytes(unit) > bucket_bytes:
            yield bucket
            bucket = []
        bucket += unit
    if bucket:
        yield bucket
