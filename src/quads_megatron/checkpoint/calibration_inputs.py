"""What a conversion reads besides the weights, checked against the layers converted before any write.

* activation amax per quantized module (``--input-amax``): JSON ``{module: number}`` or safetensors
  ``{module: tensor}`` (the tensor's max), as rollout/calibration.save_calibration writes them; each
  finite and > 0, one for every quantized module (or none at all);
* RAC plans (``--rac-plans``): safetensors of int block indices named ``<moe prefix>.w13`` /
  ``<moe prefix>.w2`` (rollout/calibration.save_rac_plans), a pair for every MoE layer converted,
  each index in [0, K/16) of its GEMM (K: hidden size for w13, MoE intermediate size for w2);
* rollout settings (``--quads-config``): a static RAC selection needs plans, static activation
  scales need input amaxes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from quads_megatron.checkpoint.modelopt import ConvertOptions
from quads_megatron.config import RolloutConfig, load_config
from quads_megatron.errors import ConvertError, QuadsConfigError
from quads_megatron.nvfp4 import BLOCK_SIZE


@dataclass(frozen=True)
class MoELayer:
    """Inner sizes of one routed-expert layer's two grouped GEMMs."""

    hidden: int | None  # K of w13 (gate/up); None when they are not quantized (--exclude)
    inter: int | None  # K of w2 (down); None when it is not quantized


def _short(names: list[str]) -> str:
    return f"{names[:3]}{' ...' if len(names) > 3 else ''}"


def _safetensors(path: str, what: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except FileNotFoundError as e:
        raise ConvertError(f"{path}: no such {what} file") from e
    except Exception as e:  # safetensors raises its own error types
        raise ConvertError(f"{path}: not a readable safetensors {what} file ({e})") from e


def check_input_amax(values: dict, where: str) -> dict[str, float]:
    """values as {module: float}; ConvertError naming the first entry that is not a finite number > 0."""
    out: dict[str, float] = {}
    for k, v in values.items():
        if not isinstance(k, str) or not k:
            raise ConvertError(f"{where}: module names must be non-empty strings, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConvertError(f"{where}: input amax of {k} is {v!r}; expected a finite number > 0")
        out[k] = float(v)
    return out


def load_input_amax(path: str) -> dict[str, float]:
    """Activation amax per module from a flat JSON object or a safetensors file (max of each tensor)."""
    if path.endswith(".json"):
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError as e:
            raise ConvertError(f"{path}: no such input amax file") from e
        except ValueError as e:
            raise ConvertError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ConvertError(f"{path}: expected a flat JSON object {{module name: activation amax}}")
        for k, v in data.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConvertError(
                    f"{path}: {k!r} is {type(v).__name__} {json.dumps(v)[:40]}; expected a number "
                    "(a flat {module name: activation amax} object)"
                )
        return check_input_amax(data, path)
    if path.endswith(".safetensors"):
        out: dict[str, float] = {}
        for k, t in _safetensors(path, "input amax").items():
            if t.numel() == 0 or t.dtype == torch.bool or t.is_complex():
                raise ConvertError(f"{path}: {k} is an empty, bool or complex tensor; expected activation amaxes")
            tf = t.float()
            if not bool(torch.isfinite(tf).all()):
                raise ConvertError(f"{path}: input amax of {k} has non-finite values; expected finite numbers > 0")
            out[k] = float(tf.max())
        return check_input_amax(out, path)
    raise ConvertError(f"{path}: input amax file must be .json or .safetensors")


def load_rac_plans(path: str) -> dict[str, dict[str, list[int]]]:
    """{moe prefix: {"w13": blocks, "w2": blocks}} from a safetensors file of int block lists."""
    plans: dict[str, dict[str, list[int]]] = {}
    for name, t in _safetensors(path, "RAC plan").items():
        prefix, _, gemm = name.rpartition(".")
        if gemm not in ("w13", "w2") or not prefix or t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
            raise ConvertError(f"{path}: {name} is not an int block list named <moe prefix>.w13|w2")
        plans.setdefault(prefix, {})[gemm] = sorted(int(i) for i in t.tolist())
    if not plans:
        raise ConvertError(f"{path}: holds no RAC plans")
    incomplete = sorted(p for p, g in plans.items() if set(g) != {"w13", "w2"})
    if incomplete:
        raise ConvertError(f"{path}: layers without both w13 and w2 plans: {incomplete[:4]}")
    return plans


def quads_extras(rollout: dict | None = None, rac_plans_file: str | None = None) -> dict:
    """The ``quads`` block of the quantization configs: rollout settings (validated like the trainer's
    YAML) and RAC plans from a safetensors file (load_rac_plans)."""
    out: dict = {}
    if rollout:
        try:
            out["rollout"] = load_config({"rollout": rollout}).to_dict()["rollout"]
        except QuadsConfigError as e:
            raise ConvertError(f"quads rollout settings: {e}") from e
    if rac_plans_file:
        out["rac_plans"] = load_rac_plans(rac_plans_file)
    return out


def _rollout(quads: dict) -> RolloutConfig:
    if "rollout" not in quads:
        return RolloutConfig()
    try:
        return load_config({"rollout": quads["rollout"]}).rollout
    except QuadsConfigError as e:
        raise ConvertError(f"quads rollout settings: {e}") from e


def check_rac_plans(plans: object, layers: dict[str, MoELayer]) -> None:
    """Plans must cover exactly the converted MoE layers, with unique block indices in range."""
    if not isinstance(plans, dict):
        raise ConvertError("RAC plans must map MoE layer prefixes to {w13, w2} block lists")
    unknown = sorted(set(plans) - set(layers))
    if unknown:
        raise ConvertError(f"RAC plans name MoE layers that are not converted: {_short(unknown)}")
    missing = sorted(set(layers) - set(plans))
    if missing:
        raise ConvertError(
            f"RAC plans cover {len(layers) - len(missing)} of {len(layers)} MoE layers converted; no plan for "
            f"{_short(missing)} (the quads_nvfp4 method refuses a checkpoint without a plan for every layer)"
        )
    for prefix, layer in sorted(layers.items()):
        for gemm, k, what in (("w13", layer.hidden, "hidden size"), ("w2", layer.inter, "MoE intermediate size")):
            blocks = plans[prefix].get(gemm) if isinstance(plans[prefix], dict) else None
            if k is None:
                raise ConvertError(f"RAC plan {prefix}.{gemm}: that GEMM is not quantized (excluded)")
            if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
                raise ConvertError(f"RAC plan {prefix}.{gemm}: expected a list of block indices, got {blocks!r}")
            bad = [b for b in blocks if not 0 <= b < k // BLOCK_SIZE]
            if bad:
                raise ConvertError(
                    f"RAC plan {prefix}.{gemm}: block index {bad[0]} is out of range [0, {k // BLOCK_SIZE}) "
                    f"for K={k} ({what} of the weights converted)"
                )
            if len(set(blocks)) != len(blocks):
                raise ConvertError(f"RAC plan {prefix}.{gemm}: repeated block indices")


def check_calibration(opts: ConvertOptions, modules: set[str], layers: dict[str, MoELayer]) -> dict[str, float]:
    """Check opts' input amaxes, RAC plans and rollout settings against the quantized modules and
    the routed MoE layers of this conversion; returns the input amaxes as floats."""
    amax = check_input_amax(dict(opts.input_amax), "input amax")
    unknown = sorted(set(amax) - modules)
    if unknown:
        raise ConvertError(f"input amax names modules that are not quantized: {_short(unknown)}")
    missing = sorted(modules - set(amax))
    if amax and missing:
        raise ConvertError(
            f"input amax covers {len(modules) - len(missing)} of {len(modules)} quantized modules; none for "
            f"{_short(missing)} (give one for every quantized linear, or none)"
        )
    quads = opts.quads or {}
    rollout = _rollout(quads)
    if rollout.activation_scale == "static" and not amax:
        raise ConvertError(
            "rollout.activation_scale is static but no input amax was given (--input-amax): the rollout "
            "would quantize activations with uncalibrated scales"
        )
    rac = rollout.rac
    if rac.enabled and rac.ratio > 0 and rac.selection == "static" and "rac_plans" not in quads:
        raise ConvertError(
            "rollout.rac.selection is static but no RAC plans were given (--rac-plans); calibrate them "
            "(examples/calibrate_rac.py) or set rollout.rac.selection: dynamic"
        )
    if "rac_plans" in quads:
        check_rac_plans(quads["rac_plans"], layers)
    return amax
