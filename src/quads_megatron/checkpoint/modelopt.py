"""ModelOpt NVFP4 naming: which HF parameters are quantized, their tensors, and the quantization configs.

Per quantized linear, as ModelOpt's own HF export writes it: ``weight`` (uint8 [N, K/2]),
``weight_scale`` (float8_e4m3fn [N, K/16]), ``weight_scale_2`` (fp32 scalar), ``input_scale`` (fp32
scalar). Gate/up (w1/w3) of one expert share one global amax, which is what the trainer's fused fc1
per-tensor scale is, so dq(converted) equals the trainer's qdq(W) bit for bit. All numbers come from
quads_megatron.nvfp4, under the variant of the QUADS config's nvfp4 section (ConvertOptions.nvfp4): a
4over6 recipe changes which codes and block scales are written, not what the tensors mean (the decode
value(q) * weight_scale * weight_scale_2 is the same), so the ModelOpt names are unchanged; the variant
is recorded in the producer block and, when not plain NVFP4, in ``quads.nvfp4`` (what the quads_nvfp4
method reads). Configs: ``hf_quant_config.json`` and config.json ``quantization_config`` in
the fields of ModelOpt's export (modelopt/torch/export: quant_utils.get_quant_config,
convert_hf_config.convert_hf_quant_config_format), which SGLang's modelopt_fp4 reader parses.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field

import torch

from quads_megatron import __version__, nvfp4
from quads_megatron.config import NVFP4Config
from quads_megatron.errors import ConvertError, NVFP4InputError

INDEX = "model.safetensors.index.json"

#: input_scale of a quantized linear when no activation amax was calibrated (no --input-amax).
#: ModelOpt writes a static input_scale for every quantized linear and stock loaders read it (some
#: allocate it uninitialised when absent). 1.0 is what SGLang's ModelOpt NVFP4 method itself uses
#: when a checkpoint has no activation scale: S_dec = 1 stands for an activation amax of 2688
#: (6 * 448), so no activation of a real model is clipped; the cost is precision on small blocks
#: (block amax below 6 * 2^-6 ~ 0.09 gets a subnormal E4M3 block scale, below ~0.006 it rounds to
#: zero). The quads_nvfp4 method ignores it: it uses dynamic per-token activation scales unless
#: rollout.activation_scale is static (which needs --input-amax).
UNCALIBRATED_INPUT_SCALE = 1.0

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
    # other files the conversion reads (calibration files, configs): their directories are never removed
    source_paths: tuple[str, ...] = ()
    # QUADS rollout extras written into the quantization configs (read by the SGLang quads_nvfp4
    # method, ignored by stock ModelOpt loaders): {"rollout": {...}, "rac_plans": {prefix: {w13, w2}}}
    quads: dict = field(default_factory=dict)
    # the NVFP4 variant (the QUADS config's nvfp4 section): weights quantized with its weight recipe,
    # input_scale made with its activation recipe, recorded in the quantization configs
    nvfp4: NVFP4Config = field(default_factory=NVFP4Config)

    def __post_init__(self) -> None:
        if not isinstance(self.nvfp4, NVFP4Config):
            raise TypeError(f"ConvertOptions.nvfp4 must be an NVFP4Config, got {type(self.nvfp4).__name__}")
        if "nvfp4" in (self.quads or {}) and self.quads["nvfp4"] != self.nvfp4.to_dict():
            raise ConvertError(
                f"ConvertOptions.quads['nvfp4'] {self.quads['nvfp4']} differs from ConvertOptions.nvfp4 "
                f"{self.nvfp4.to_dict()}: pass the variant once, as nvfp4="
            )

    def fingerprint(self) -> str:
        """Hash of the options that shape the output (resuming needs the same ones)."""
        shaping = {k: v for k, v in asdict(self).items() if k in ("include_shared_experts", "exclude", "input_amax")}
        if not self.nvfp4.is_default:
            shaping["nvfp4"] = self.nvfp4.to_dict()
        return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def quads_block(self) -> dict:
        """The ``quads`` block of the quantization configs: opts.quads, plus ``nvfp4`` (the variant) unless
        it is plain NVFP4 (a checkpoint without it is plain, as stock ModelOpt checkpoints are)."""
        block = {k: v for k, v in (self.quads or {}).items() if k != "nvfp4"}
        if not self.nvfp4.is_default:
            block["nvfp4"] = self.nvfp4.to_dict()
        return block


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


def routed_moe_gemm(module: str) -> tuple[str, str] | None:
    """(MoE layer prefix, 'w13' or 'w2') of a routed-expert module, as the rollout's FusedMoE names
    them (``model.layers.0.mlp.experts.3.up_proj`` -> ``('model.layers.0.mlp.experts', 'w13')``)."""
    for rx in _EXPERT_RE:
        m = rx.match(module + ".weight")
        if m:
            layer = m["expert"].rpartition(".")[0]
            return layer, "w13" if m["proj"] in _GATE_UP else "w2"
    return None


def check_weight(weight: torch.Tensor, name: str) -> None:
    if weight.dim() != 2:
        raise ConvertError(f"{name}: expected a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
    try:
        nvfp4.check_quantizable(weight, name)
    except NVFP4InputError as e:
        raise ConvertError(str(e)) from e


def quantize_linear(
    weight: torch.Tensor,
    name: str,
    global_amax: torch.Tensor | None = None,
    recipe: nvfp4.NVFP4Recipe | None = None,
) -> nvfp4.NVFP4Tensor:
    """Contract quantization of one [N, K] linear weight (recipe: the weights' variant) with a readable
    error on bad input."""
    check_weight(weight, name)
    return nvfp4.quantize(weight, "tensor", global_amax, check=False, recipe=recipe)


def modelopt_tensors(
    module: str, q: nvfp4.NVFP4Tensor, input_amax: float | None, recipe: nvfp4.NVFP4Recipe | None = None
) -> dict[str, torch.Tensor]:
    """ModelOpt tensors of one quantized linear; input_scale (of a calibrated input_amax) with the
    activations' recipe (recipe): S_dec = amax / (6 * e4m3_max)."""
    out = {f"{module}.{k}": v.contiguous() for k, v in nvfp4.to_modelopt(q).items()}
    if input_amax is not None:
        out[f"{module}.input_scale"] = nvfp4.input_scale_from_amax(torch.tensor(float(input_amax)), recipe)
    return out


def fill_input_scales(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add UNCALIBRATED_INPUT_SCALE (fp32 scalar) as ``input_scale`` of every quantized linear
    (one with a ``weight_scale_2``) that has none; returns tensors."""
    for name in [n for n in tensors if n.endswith(".weight_scale_2")]:
        key = name[: -len("weight_scale_2")] + "input_scale"
        if key not in tensors:
            tensors[key] = torch.tensor(UNCALIBRATED_INPUT_SCALE, dtype=torch.float32)
    return tensors


def excluded_linears(names: list[str], targets: dict[str, tuple[str, str]]) -> set[str]:
    return {n[: -len(".weight")] for n in names if n.endswith(".weight") and n not in targets}


def quant_configs(
    exclude: list[str], quads: dict | None = None, calibrated: bool = False, nvfp4_config: NVFP4Config | None = None
) -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json quantization_config) for an NVFP4 checkpoint whose
    quantized linears are everything but ``exclude``; ``quads`` (rollout settings and RAC plans for
    the quads_nvfp4 method, ignored by stock loaders) is added to both when given. The KV cache is
    not quantized: kv_cache_quant_algo is null and, as in ModelOpt's export, no kv_cache_scheme.
    The producer records whether input_scale values are calibrated or UNCALIBRATED_INPUT_SCALE
    (``"input_scale": "default"``), so a static-activation rollout can refuse the latter, and the NVFP4
    variant (``"nvfp4"``: the config section, and the recipes of weights and activations it gives)."""
    cfg = nvfp4_config or NVFP4Config()
    producer: dict = {"name": "quads_megatron", "version": __version__}
    producer["input_scale"] = "calibrated" if calibrated else "default"
    producer["nvfp4"] = {
        **cfg.to_dict(),
        "weights": cfg.weights.to_dict(),
        "activations": cfg.activations.to_dict(),
    }
    hf_quant: dict = {
        "producer": producer,
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": nvfp4.BLOCK_SIZE,
            "exclude_modules": list(exclude),
        },
    }
    scheme = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": nvfp4.BLOCK_SIZE}
    config: dict = {
        "config_groups": {
            "group_0": {"input_activations": dict(scheme), "weights": dict(scheme), "targets": ["Linear"]}
        },
        "ignore": list(exclude),
        "quant_algo": "NVFP4",
        "producer": producer,
        "quant_method": "modelopt",
    }
    if quads:
        hf_quant["quads"] = quads
        config["quads"] = quads
    return hf_quant, config


def read_model_config(src: str) -> dict:
    """src/config.json as a dict ({} when absent); ConvertError when it is not a JSON object."""
    path = os.path.join(src, "config.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise ConvertError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def write_quant_configs(
    model_config: dict,
    dst: str,
    exclude: list[str],
    quads: dict | None = None,
    calibrated: bool = False,
    nvfp4_config: NVFP4Config | None = None,
) -> None:
    """hf_quant_config.json, and the model's config.json with quantization_config, into dst."""
    hf_quant, quantization_config = quant_configs(exclude, quads, calibrated, nvfp4_config)
    with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
        json.dump(hf_quant, f, indent=1)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**model_config, "quantization_config": quantization_config}, f, indent=1)
