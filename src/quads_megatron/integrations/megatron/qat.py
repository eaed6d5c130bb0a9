"""Fork-free Megatron-Core adapter: NVFP4 fake-quant of MoE expert weights (asymmetric QAT).

What is patched (class attributes, restored by remove()):
* MoELayer.__init__: after construction, tag the expert linears (routed and shared) with a
  QuadsTarget (kind, fc1/fc2, owning MoE layer, amax group). Models built before apply() are
  tagged by apply(model=...).
* ColumnParallelLinear / RowParallelLinear .forward (local spec, SequentialMLP experts): for a
  tagged module the weight attribute is shadowed by fake_quant(weight) for the call.
* TELinear / TEGroupedLinear ._get_weight_tensors (TE spec; TEGroupedMLP per-expert weight{i}
  or one grouped [E, N, K] weight): returns fake_quant(w) for each weight.
Router, attention and every untagged linear are untouched; no parameter or buffer is added, so
state dicts and sharded checkpoints are unchanged. All math lives in quads_megatron.fake_quant.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from quads_megatron.config import QuadsConfig
from quads_megatron.errors import QuadsPatchError
from quads_megatron.fake_quant import FakeQuantSpec, fake_quant_weight

#: megatron-core versions this adapter was written against: [0.14, 0.20)
SUPPORTED_RANGE = ((0, 14), (0, 20))
ALLOW_UNTESTED_ENV = "QUADS_ALLOW_UNTESTED_MEGATRON"


@dataclass
class QuadsTarget:
    """Tag set on an expert linear: which expert kind and linear it is, and its MoE layer."""

    kind: str  # 'routed' | 'shared'
    linear: str  # 'fc1' | 'fc2'
    layer_ref: Any  # weakref to the MoELayer (layer_number is read at call time)
    amax_group: Any = None
    experts_dim0: bool = False

    @property
    def layer_number(self) -> int | None:
        layer = self.layer_ref()
        return getattr(layer, "layer_number", None) if layer is not None else None


@dataclass
class _State:
    config: QuadsConfig | None = None
    originals: dict[tuple[type, str], Any] = field(default_factory=dict)


STATE = _State()


def megatron_core_version() -> str:
    try:
        from megatron.core.package_info import __version__
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise QuadsPatchError("megatron-core is not installed (pip install megatron-core)") from e
    return __version__


def check_version(version: str | None = None) -> str:
    """Refuse megatron-core versions outside SUPPORTED_RANGE unless QUADS_ALLOW_UNTESTED_MEGATRON=1."""
    version = version or megatron_core_version()
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError as e:
        raise QuadsPatchError(f"cannot parse megatron-core version {version!r}") from e
    lo, hi = SUPPORTED_RANGE
    if not lo <= major_minor < hi and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise QuadsPatchError(
            f"megatron-core {version} is outside the versions quads_megatron supports "
            f"({lo[0]}.{lo[1]} <= v < {hi[0]}.{hi[1]}); the expert internals it patches may have changed. "
            f"Set {ALLOW_UNTESTED_ENV}=1 to try anyway."
        )
    return version


# ----------------------------------------------------------------------------- decisions


def _spec_for(module: torch.nn.Module) -> FakeQuantSpec | None:
    target: QuadsTarget | None = getattr(module, "_quads_target", None)
    cfg = STATE.config
    if target is None or cfg is None or not cfg.trainer.enabled:
        return None
    t = cfg.trainer
    if target.kind not in t.experts or target.linear not in t.linears or not t.wants_layer(target.layer_number):
        return None
    return FakeQuantSpec(t.scale_mode, target.experts_dim0, target.amax_group)


def _fq(module: torch.nn.Module, w: torch.Tensor, spec: FakeQuantSpec) -> torch.Tensor:
    assert STATE.config is not None
    fused = bool(
        getattr(module, "gradient_accumulation_fusion", False) or getattr(module, "fuse_wgrad_accumulation", False)
    )
    return fake_quant_weight(w, spec, cache=STATE.config.trainer.cache_qdq, fused_wgrad=fused)


def _weight_names(module: torch.nn.Module) -> list[str]:
    """'weight' and per-expert 'weight0', 'weight1', ... parameters of one linear."""
    return [n for n in module._parameters if n == "weight" or (n.startswith("weight") and n[6:].isdigit())]


# ----------------------------------------------------------------------------- wrappers


def _wrap_forward(orig):
    def forward(self, *args, **kwargs):
        spec = _spec_for(self)
        if spec is None:
            return orig(self, *args, **kwargs)
        shadowed = []
        try:
            for name in _weight_names(self):
                object.__setattr__(self, name, _fq(self, self._parameters[name], spec))
                shadowed.append(name)
            return orig(self, *args, **kwargs)
        finally:
            for name in shadowed:
                del self.__dict__[name]

    forward.__wrapped__ = orig  # type: ignore[attr-defined]
    return forward


def _wrap_get_weight_tensors(orig):
    def _get_weight_tensors(self):
        weights = orig(self)
        spec = _spec_for(self)
        if spec is None:
            return weights
        if len(weights) == 1 and weights[0].dim() == 3:  # one grouped [E, N, K] weight
            spec = FakeQuantSpec(spec.scale_mode, True, spec.amax_group)
        return [_fq(self, w, spec) for w in weights]

    _get_weight_tensors.__wrapped__ = orig  # type: ignore[attr-defined]
    return _get_weight_tensors


def _wrap_moe_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        tag_moe_layer(self)

    __init__.__wrapped__ = orig  # type: ignore[attr-defined]
    return __init__


# ----------------------------------------------------------------------------- tagging


def _linear_classes() -> dict[str, type]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    classes: dict[str, type] = {"ColumnParallelLinear": ColumnParallelLinear, "RowParallelLinear": RowParallelLinear}
    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception:  # TE missing or broken: only the local spec can be patched
        return classes
    for name in ("TELinear", "TEGroupedLinear"):
        cls = getattr(te_ext, name, None)
        if isinstance(cls, type):
            classes[name] = cls
    return classes


def tag_moe_layer(moe_layer: torch.nn.Module) -> int:
    """Tag the expert linears of one MoELayer; returns how many were tagged."""
    config = getattr(moe_layer, "config", None)
    if getattr(config, "use_transformer_engine_op_fuser", False):
        raise QuadsPatchError(
            "TEGroupedMLP with use_transformer_engine_op_fuser builds fused TE ops that bypass the weight "
            "hook; turn the op fuser off for QUADS QAT"
        )
    ref = weakref.ref(moe_layer)
    count = 0
    experts = getattr(moe_layer, "experts", None)
    if experts is not None:
        if type(experts).__name__ == "GroupedMLP" or hasattr(experts, "weight1"):
            raise QuadsPatchError(
                "legacy GroupedMLP experts (grouped_gemm weight1/weight2) are not supported; build the experts "
                "as TEGroupedMLP (moe_grouped_gemm with Transformer Engine) or SequentialMLP"
            )
        group = getattr(experts, "tp_group", None)
        if hasattr(experts, "local_experts"):  # SequentialMLP: one MLP per expert
            for expert in experts.local_experts:
                count += _tag_mlp(expert, "routed", ref, group)
        else:  # TEGroupedMLP: grouped linears, one weight per expert (or one [E, N, K])
            count += _tag_mlp(experts, "routed", ref, group)
    shared = getattr(moe_layer, "shared_experts", None)
    if shared is not None:
        count += _tag_mlp(shared, "shared", ref, getattr(shared, "tp_group", None))
    return count


def _tag_mlp(mlp: torch.nn.Module, kind: str, ref: Any, group: Any) -> int:
    n = 0
    for linear in ("fc1", "fc2"):
        mod = getattr(mlp, f"linear_{linear}", None)
        if mod is not None:
            mod._quads_target = QuadsTarget(kind, linear, ref, group)
            n += 1
    return n


def tag_model(model: Any) -> int:
    """Tag every MoELayer inside model (a module or a list of modules, e.g. virtual pipeline chunks)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return sum(tag_moe_layer(m) for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer))


# ----------------------------------------------------------------------------- apply / remove


def _patch(cls: type, name: str, wrapper) -> None:
    key = (cls, name)
    if key in STATE.originals:
        return
    STATE.originals[key] = cls.__dict__.get(name, _INHERITED)
    setattr(cls, name, wrapper(getattr(cls, name)))


_INHERITED = object()


def apply(config: QuadsConfig, model: Any = None) -> None:
    """Install the patches (idempotent); with model, also tag MoE layers built before apply()."""
    check_version()
    from megatron.core.transformer.moe.moe_layer import MoELayer

    STATE.config = config
    _patch(MoELayer, "__init__", _wrap_moe_init)
    for name, cls in _linear_classes().items():
        if name.startswith("TE"):
            if hasattr(cls, "_get_weight_tensors"):
                _patch(cls, "_get_weight_tensors", _wrap_get_weight_tensors)
            else:
                _patch(cls, "forward", _wrap_forward)
        else:
            _patch(cls, "forward", _wrap_forward)
    if model is not None:
        tag_model(model)


def remove() -> None:
    """Restore every patched class attribute; tags left on modules are inert without the patches."""
    for (cls, name), orig in STATE.originals.items():
        if orig is _INHERITED:
            delattr(cls, name)
        else:
            setattr(cls, name, orig)
    STATE.originals.clear()
    STATE.config = None


def is_applied() -> bool:
    return bool(STATE.originals)
