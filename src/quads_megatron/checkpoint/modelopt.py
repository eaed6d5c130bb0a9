"""ModelOpt NVFP4 naming: which HF parameters are quantized, their tensors, and the quantization configs.

Per quantized linear ``weight`` (uint8 [N, K/2]), ``weight_scale`` (float8_e4m3fn [N, K/16]),
``weight_scale_2`` (fp32 scalar), ``input_scale`` (fp32); gate/up (w1/w3) of one expert share one
global amax, which is what the trainer's fused fc1 per-tensor scale is, so dq(converted) equals the
trainer's qdq(W) bit for bit. All numbers come from quads_megatron.nvfp4.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field

import torch
from safetensors.torch import load_file

from quads_megatron import __version__, nvfp4
from quads_megatron.errors import ConvertError, NVFP4InputError

INDEX = "model.safetensors.index.json"
STATE = "quads_convert_state.json"

# expert projection names: (regex on the parameter name, role)
_EXPERT_RE = [
    re.compile(r"^(?P<mod>(?P<expert>.*\.experts\.(?P<idx>\d+))\.(?P<proj>gate_proj|up_proj|down_proj))\.weight$"),
    re.compile(r"^(?P<mod>(?P<expert>.*\.block_sparse_moe\.experts\.(?P<idx>\d+))\.(?P<proj>w1|w3|w2))\.weight$"),
]
_SHARED_RE = re.compile(r"^(?P<mod>(?P<expert>.*\.shared_experts?)\.(?P<proj>gate_proj|up_proj|down_proj))\.weight$")
_GATE_UP = {"gate_proj": "up_proj", "up_proj": "gate_proj", "w1": "w3", "w3": "w1"}


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


def check_weight(weight: torch.Tensor, name: str) -> None:
    if weight.dim() != 2:
        raise ConvertError(f"{name}: expected a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
    try:
        nvfp4.check_quantizable(weight, name)
    except NVFP4InputError as e:
        raise ConvertError(str(e)) from e


def quantize_linear(weight: torch.Tensor, name: str, global_amax: torch.Tensor | None = None) -> nvfp4.NVFP4Tensor:
    """Contract quantization of one [N, K] linear weight with a readable error on bad input."""
    check_weight(weight, name)
    return nvfp4.quantize(weight, "tensor", global_amax, check=False)


def modelopt_tensors(module: str, q: nvfp4.NVFP4Tensor, input_amax: float | None) -> dict[str, torch.Tensor]:
    out = {f"{module}.{k}": v.contiguous() for k, v in nvfp4.to_modelopt(q).items()}
    if input_amax is not None:
        out[f"{module}.input_scale"] = nvfp4.input_scale_from_amax(torch.tensor(float(input_amax)))
    return out


def excluded_linears(names: list[str], targets: dict[str, tuple[str, str]]) -> set[str]:
    return {n[: -len(".weight")] for n in names if n.endswith(".weight") and n not in targets}


def write_quant_configs(src: str, dst: str, exclude: list[str], quads: dict | None = None) -> None:
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
