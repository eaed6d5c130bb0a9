"""QUADS configuration: one YAML file (or dict) for trainer QAT, rollout RAC and scales.

Example (every key optional; these are the defaults)::

    trainer:
      enabled: true
      experts: [routed]          # routed and/or shared
      linears: [fc1, fc2]
      layers: all                # 'all' or a list of layer numbers (1-based, as Megatron counts)
      scale_mode: tensor         # one NVFP4 global scale per expert weight (the only mode; see below)
      cache_qdq: true            # one QDQ per weight version, reused across micro-batches
    rollout:
      activation_scale: dynamic  # dynamic (per-token global scale) | static (calibrated input_scale)
      rac:
        enabled: true
        ratio: 0.5               # fraction of K compensated, rounded up to 16 channels (QUADS: 50%)
        selection: dynamic       # dynamic (per token, no calibration) | static (calibrated per layer)
        metric: residual         # static plans' calibration statistic: residual | amax
      weight_layout: auto        # expert weights in the GEMMs' tiled order where shapes allow | tiled | row_major
    nvfp4:                       # the NVFP4 variant, in the fields of TE's NVFP4BlockScaling recipe
      nvfp4_4over6: none         # 4over6 block scaling for: none | weights | activations | all
      nvfp4_4over6_e4m3_use_256: all  # 4over6 tensors whose global scale maps amax to 256, not 448
      nvfp4_4over6_err_mode: MAE # 4over6 candidate error: MAE | MSE
      row_scaled_activation: true  # dynamic activation scales per token (the only dynamic mode served)

* trainer.scale_mode: only ``tensor``. ModelOpt NVFP4 checkpoints, ``quads convert``, live sync and
  the quads_nvfp4 rollout hold one per-tensor global scale (``weight_scale_2``) per expert weight,
  so the trainer fake-quantizes with exactly that; a per-row scale would train weights the rollout
  never sees.
* rollout.rac.metric: the statistic RAC calibration ranks 16-channel blocks by when it builds static
  plans (``record_expert_inputs(model, config=...)``, examples/calibrate_rac.py): ``residual`` = the
  squared NVFP4 residual |x - dq(q(x))|^2 summed over rows, ``amax`` = the block's max |x|.
* rollout.weight_layout: the quads_nvfp4 SGLang method permutes each expert's NVFP4 codes and scales in
  place into the tiled order the grouped GEMMs read fastest (kernels.weight_layout) once loaded, and keeps
  every later write row-major (integrations.sglang.tiled_layout). ``auto``: where hidden and intermediate
  per partition are multiples of 128, else row-major; ``tiled``: refuse a layer that cannot be; ``row_major``:
  never (what ``get_weights_by_name`` and ``load_format="direct"`` updates then see is the checkpoint's
  order).
* nvfp4: one section for trainer fake-quant, ``quads convert``, live sync and the rollout, so all of them
  make the same numbers (quads_megatron.nvfp4.NVFP4Recipe; tests/test_te_golden.py checks them against
  TE's reference). Key names and values are TE's (``NVFP4BlockScaling`` / ``NVTE_NVFP4_*``), with one
  difference: row_scaled_activation defaults to true, the rollout's per-token dynamic scale; false (TE's
  default, one dynamic amax over a whole activation tensor, which makes a token's numbers depend on the
  rest of the batch) is refused. rollout.activation_scale: static replaces the dynamic amax by the
  calibrated one. Row-scaled weights are trainer.scale_mode: row (refused, see above).
* No top-level ``exclude``: the trainer picks what it fake-quantizes with trainer.experts / linears /
  layers; a checkpoint keeps modules BF16 with ``quads convert --exclude GLOB``.

Errors name the offending key with its dotted path (QuadsConfigError).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from quads_megatron.errors import QuadsConfigError
from quads_megatron.nvfp4 import ERR_MODES, NVFP4Recipe

#: rollout.weight_layout values: how the quads_nvfp4 SGLang method stores expert weights once loaded
WEIGHT_LAYOUTS = ("auto", "tiled", "row_major")
#: trainer.scale_mode values: per-tensor only (what ModelOpt checkpoints and the rollout hold)
TRAINER_SCALE_MODES = ("tensor",)

#: keys that were accepted once and are refused now, with what to use instead
_REMOVED_KEYS = {
    ("QuadsConfig", "exclude"): (
        "not a QUADS config key: the trainer selects what it fake-quantizes with trainer.experts, "
        "trainer.linears and trainer.layers; keep modules BF16 in a checkpoint with `quads convert --exclude GLOB`"
    ),
}


@dataclass(frozen=True)
class RACConfig:
    enabled: bool = True
    ratio: float = 0.5
    selection: str = "dynamic"
    metric: str = "residual"

    def __post_init__(self) -> None:
        _check_type("rollout.rac.enabled", self.enabled, bool)
        _check_type("rollout.rac.ratio", self.ratio, (int, float))
        if not 0.0 <= float(self.ratio) <= 1.0:
            raise QuadsConfigError(f"rollout.rac.ratio: must be in [0, 1], got {self.ratio!r}")
        _check_choice("rollout.rac.selection", self.selection, ("static", "dynamic"))
        _check_choice("rollout.rac.metric", self.metric, ("residual", "amax"))

    def num_channels(self, k: int) -> int:
        """Compensated channels for a GEMM of inner size k: ceil(ratio*k) rounded up to 16, <= k."""
        if not self.enabled or self.ratio == 0:
            return 0
        n = math.ceil(float(self.ratio) * k - 1e-9)
        return min(k, -(-n // 16) * 16)


@dataclass(frozen=True)
class RolloutConfig:
    activation_scale: str = "dynamic"
    rac: RACConfig = field(default_factory=RACConfig)
    weight_layout: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("rollout.activation_scale", self.activation_scale, ("dynamic", "static"))
        _check_choice("rollout.weight_layout", self.weight_layout, WEIGHT_LAYOUTS)


@dataclass(frozen=True)
class TrainerConfig:
    enabled: bool = True
    experts: tuple[str, ...] = ("routed",)
    linears: tuple[str, ...] = ("fc1", "fc2")
    layers: str | tuple[int, ...] = "all"
    scale_mode: str = "tensor"
    cache_qdq: bool = True

    def __post_init__(self) -> None:
        _check_type("trainer.enabled", self.enabled, bool)
        _check_type("trainer.cache_qdq", self.cache_qdq, bool)
        _check_subset("trainer.experts", self.experts, ("routed", "shared"))
        _check_subset("trainer.linears", self.linears, ("fc1", "fc2"))
        if self.scale_mode not in TRAINER_SCALE_MODES:
            raise QuadsConfigError(
                f"trainer.scale_mode: only 'tensor' is supported, got {self.scale_mode!r}: ModelOpt NVFP4 "
                "checkpoints, quads convert, live sync and the quads_nvfp4 rollout hold one per-tensor global "
                "scale (weight_scale_2) per expert weight, so the trainer must fake-quantize per tensor too"
            )
        if self.layers != "all":
            if not isinstance(self.layers, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in self.layers
            ):
                raise QuadsConfigError(
                    f"trainer.layers: expected 'all' or a list of layer numbers >= 1, got {self.layers!r}"
                )

    def wants_layer(self, layer_number: int | None) -> bool:
        return self.layers == "all" or layer_number is None or layer_number in self.layers


#: which tensors a 4over6 option covers (TE: nvfp4_4over6, nvfp4_4over6_e4m3_use_256)
FOUR_OVER_SIX_SCOPES = ("none", "weights", "activations", "all")


@dataclass(frozen=True)
class NVFP4Config:
    """nvfp4: the variant of every NVFP4 number made (see the module docstring); .weights and .activations
    are the per-tensor NVFP4Recipe of expert weights and of the rollout's activations, as TE builds its
    forward quantizers from the same fields (4over6 with a 256 bound only where both scopes cover it)."""

    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    row_scaled_activation: bool = True

    def __post_init__(self) -> None:
        _check_choice("nvfp4.nvfp4_4over6", self.nvfp4_4over6, FOUR_OVER_SIX_SCOPES)
        _check_choice("nvfp4.nvfp4_4over6_e4m3_use_256", self.nvfp4_4over6_e4m3_use_256, FOUR_OVER_SIX_SCOPES)
        mode = self.nvfp4_4over6_err_mode
        _check_choice("nvfp4.nvfp4_4over6_err_mode", mode.upper() if isinstance(mode, str) else mode, ERR_MODES)
        object.__setattr__(self, "nvfp4_4over6_err_mode", mode.upper())
        _check_type("nvfp4.row_scaled_activation", self.row_scaled_activation, bool)
        if not self.row_scaled_activation:
            raise QuadsConfigError(
                "nvfp4.row_scaled_activation: false (TE's default: one dynamic amax per activation tensor, so a "
                "token's numbers depend on the rest of its batch) is not served; the rollout scales activations "
                "per token (true, TE's row_scaled_activation=True) or by a calibrated amax (rollout.activation_scale: "
                "static)"
            )

    def recipe(self, tensors: str) -> NVFP4Recipe:
        """The NVFP4Recipe of 'weights' or 'activations'."""
        if tensors not in ("weights", "activations"):
            raise ValueError(f"tensors must be 'weights' or 'activations', got {tensors!r}")
        if self.nvfp4_4over6 not in ("all", tensors):
            return NVFP4Recipe()
        e4m3_max = 256 if self.nvfp4_4over6_e4m3_use_256 in ("all", tensors) else 448
        return NVFP4Recipe(use_4over6=True, e4m3_max=e4m3_max, err_mode=self.nvfp4_4over6_err_mode)

    @property
    def weights(self) -> NVFP4Recipe:
        return self.recipe("weights")

    @property
    def activations(self) -> NVFP4Recipe:
        return self.recipe("activations")

    @property
    def is_default(self) -> bool:
        """Plain NVFP4 for weights and activations (what a checkpoint without an nvfp4 record holds)."""
        return self.weights == NVFP4Recipe() and self.activations == NVFP4Recipe()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class QuadsConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    nvfp4: NVFP4Config = field(default_factory=NVFP4Config)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> QuadsConfig:
        return _build(cls, data or {}, "")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> QuadsConfig:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise QuadsConfigError(f"{path}: cannot read the QUADS config: {e.strerror or e}") from e
        except yaml.YAMLError as e:
            raise QuadsConfigError(f"{path}: not valid YAML: {e}") from e
        if data is not None and not isinstance(data, dict):
            raise QuadsConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


def load_config(source: QuadsConfig | dict[str, Any] | str | os.PathLike[str] | None) -> QuadsConfig:
    """A QuadsConfig from a config, a dict, a YAML path, or None (defaults)."""
    if source is None:
        return QuadsConfig()
    if isinstance(source, QuadsConfig):
        return source
    if isinstance(source, dict):
        return QuadsConfig.from_dict(source)
    return QuadsConfig.from_yaml(source)


# ----------------------------------------------------------------------------- helpers


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise QuadsConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in data:
        removed = _REMOVED_KEYS.get((cls.__name__, name))
        if removed is not None:
            raise QuadsConfigError(f"{prefix}{name}: {removed}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise QuadsConfigError(
            f"{prefix}{unknown[0]}: unknown key (allowed under {where}: {', '.join(sorted(fields))})"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        sub = _NESTED.get((cls.__name__, name))
        if sub is not None:
            kwargs[name] = _build(sub, value if value is not None else {}, f"{prefix}{name}.")
        elif isinstance(value, list):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    return cls(**kwargs)


_NESTED: dict[tuple[str, str], type] = {
    ("QuadsConfig", "trainer"): TrainerConfig,
    ("QuadsConfig", "rollout"): RolloutConfig,
    ("RolloutConfig", "rac"): RACConfig,
    ("QuadsConfig", "nvfp4"): NVFP4Config,
}


def _check_type(key: str, value: Any, types: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise QuadsConfigError(f"{key}: expected a number, got a boolean {value!r}")
    if not isinstance(value, types):
        raise QuadsConfigError(f"{key}: expected {_names(types)}, got {type(value).__name__} {value!r}")


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise QuadsConfigError(f"{key}: must be one of {list(choices)}, got {value!r}")


def _check_subset(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, tuple) or not value or any(v not in choices for v in value):
        raise QuadsConfigError(f"{key}: expected a non-empty list from {list(choices)}, got {value!r}")


def _names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
