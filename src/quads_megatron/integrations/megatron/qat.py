"""Fork-free Megatron-Core adapter: NVFP4 fake-quant of MoE expert weights (asymmetric QAT).

What is patched (class attributes, restored by remove()):
* MoELayer.__init__: after construction, tag the expert linears (routed and shared) with a
  QuadsTarget (kind, fc1/fc2, owning MoE layer, amax group). Models built before apply() are
  tagged by apply(model=...).
* MoELayer.forward: an untagged MoE layer whose experts the config quantizes (built before
  apply() and not passed as model=) raises QuadsPatchError instead of training unquantized;
  leave_unquantized(model) marks a model (a reference copy) that is meant to stay BF16.
* ColumnParallelLinear / RowParallelLinear .forward (local spec, SequentialMLP experts): for a
  tagged module the weight attribute is shadowed by fake_quant(weight) for the call.
* TELinear / TEGroupedLinear ._get_weight_tensors (TE spec; TEGroupedMLP per-expert weight{i}
  or one grouped [E, N, K] weight): returns fake_quant(w) for each weight.
Router, attention and every untagged linear are untouched; no parameter or buffer is added, so
state dicts and sharded checkpoints are unchanged. All math lives in quads_megatron.fake_quant.

Refused with QuadsPatchError (from the Megatron config when the layer is tagged, else at first use),
for layers whose experts the config quantizes: the TE op fuser; TE's delayed expert wgrad
(delay_wgrad_compute, overlap_dispatch_backward_with_experts_wgrad) without
gradient_accumulation_fusion (TE's backward_dw would write the gradient onto the fake-quantized
copies, not the parameters); TE's single grouped expert weight (moe_single_grouped_weight, a
GroupedTensor); Megatron-FSDP (init_model_with_meta_device, or FSDP / DTensor expert parameters).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from quads_megatron.config import QuadsConfig
from quads_megatron.errors import QuadsPatchError
from quads_megatron.fake_quant import FakeQuantSpec, fake_quant_weight, fake_quant_weights

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
    return FakeQuantSpec(t.scale_mode, target.experts_dim0, target.amax_group, cfg.nvfp4.weights)


def _fused_wgrad(module: torch.nn.Module) -> bool:
    return bool(
        getattr(module, "gradient_accumulation_fusion", False) or getattr(module, "fuse_wgrad_accumulation", False)
    )


def _fq(module: torch.nn.Module, w: torch.Tensor, spec: FakeQuantSpec) -> torch.Tensor:
    assert STATE.config is not None
    _refuse_fsdp_param(w)
    return fake_quant_weight(w, spec, cache=STATE.config.trainer.cache_qdq, fused_wgrad=_fused_wgrad(module))


def _fq_all(module: torch.nn.Module, ws: list[torch.Tensor], spec: FakeQuantSpec) -> list[torch.Tensor]:
    """_fq of every per-expert weight of one grouped linear (their QDQs computed together)."""
    assert STATE.config is not None
    for w in ws:
        _refuse_fsdp_param(w)
    return fake_quant_weights(ws, spec, cache=STATE.config.trainer.cache_qdq, fused_wgrad=_fused_wgrad(module))


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
        if getattr(self, "single_grouped_weight", False):
            raise QuadsPatchError(_SINGLE_GROUPED)
        if len(weights) == 1 and weights[0].dim() == 3:  # one grouped [E, N, K] weight
            spec = dataclasses.replace(spec, experts_dim0=True)
        return _fq_all(self, weights, spec)

    _get_weight_tensors.__wrapped__ = orig  # type: ignore[attr-defined]
    return _get_weight_tensors


def _wrap_moe_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        tag_moe_layer(self)

    __init__.__wrapped__ = orig  # type: ignore[attr-defined]
    return __init__


def _wrap_moe_forward(orig):
    def forward(self, *args, **kwargs):
        if self.__dict__.get("_quads_state") is None and _would_quantize(self):
            raise QuadsPatchError(
                f"MoE layer {getattr(self, 'layer_number', None)} was built before quads_megatron.apply(), so its "
                "experts are not fake-quantized: pass model=... to apply() (or apply before building the model); "
                "to keep a model BF16 on purpose call quads_megatron.integrations.megatron.qat.leave_unquantized(model)"
            )
        return orig(self, *args, **kwargs)

    forward.__wrapped__ = orig  # type: ignore[attr-defined]
    return forward


# ----------------------------------------------------------------------------- refusals

_SINGLE_GROUPED = (
    "moe_single_grouped_weight=True keeps TE's expert weights in one GroupedTensor, which the QUADS weight "
    "hook cannot fake-quantize with a gradient to the parameter; set moe_single_grouped_weight=False "
    "(one weight{i} parameter per expert)"
)


def _would_quantize(moe_layer: torch.nn.Module) -> bool:
    """Whether the current config fake-quantizes any expert of moe_layer (layer number unknown: yes)."""
    cfg = STATE.config
    if cfg is None or not cfg.trainer.enabled:
        return False
    t = cfg.trainer
    if not t.wants_layer(getattr(moe_layer, "layer_number", None)):
        return False
    routed = "routed" in t.experts and getattr(moe_layer, "experts", None) is not None
    shared = "shared" in t.experts and getattr(moe_layer, "shared_experts", None) is not None
    return routed or shared


def _refuse_unsupported_config(config: Any) -> None:
    """QuadsPatchError for Megatron settings under which fake-quantized expert weights train wrongly."""
    if getattr(config, "use_transformer_engine_op_fuser", False):
        raise QuadsPatchError(
            "TEGroupedMLP with use_transformer_engine_op_fuser builds fused TE ops that bypass the weight "
            "hook; turn the op fuser off for QUADS QAT"
        )
    for name in ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad"):
        if getattr(config, name, False) and not getattr(config, "gradient_accumulation_fusion", False):
            raise QuadsPatchError(
                f"{name}=True without gradient_accumulation_fusion: TE's delayed expert wgrad (backward_dw) "
                "writes the weight gradient onto the fake-quantized weight copies, so the expert parameters "
                f"would get none; set gradient_accumulation_fusion=True (--gradient-accumulation-fusion) or "
                f"{name}=False"
            )
    if getattr(config, "moe_single_grouped_weight", False):
        raise QuadsPatchError(_SINGLE_GROUPED)
    if getattr(config, "init_model_with_meta_device", False):
        raise QuadsPatchError(_FSDP)


_FSDP = (
    "Megatron-FSDP (use_megatron_fsdp, init_model_with_meta_device) shards the expert weights (DTensor) and "
    "gathers them outside the QUADS weight hook, which is not supported; train with Megatron DDP "
    "(use_megatron_fsdp=False, init_model_with_meta_device=False; the distributed optimizer is fine)"
)
_DTENSOR: list[type] = []


def _refuse_fsdp_param(w: torch.Tensor) -> None:
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch without DTensor
            DTensor = type("NoDTensor", (), {})
        _DTENSOR.append(DTensor)
    if getattr(w, "__fsdp_param__", False) or isinstance(w, _DTENSOR[0]):
        raise QuadsPatchError(_FSDP)


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
    """Tag the expert linears of one MoELayer; returns how many were tagged. QuadsPatchError (nothing
    tagged) when the layer's Megatron config cannot train fake-quantized experts correctly."""
    if _would_quantize(moe_layer):
        _refuse_unsupported_config(getattr(moe_layer, "config", None))
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
    moe_layer._quads_state = "tagged"
    return count


def _tag_mlp(mlp: torch.nn.Module, kind: str, ref: Any, group: Any) -> int:
    n = 0
    for linear in ("fc1", "fc2"):
        mod = getattr(mlp, f"linear_{linear}", None)
        if mod is not None:
            mod._quads_target = QuadsTarget(kind, linear, ref, group)
            n += 1
    return n


def _moe_layers(model: Any) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def tag_model(model: Any) -> int:
    """Tag every MoELayer inside model (a module or a list of modules, e.g. virtual pipeline chunks).
    Every layer is checked before the first is tagged."""
    layers = _moe_layers(model)
    for layer in layers:
        if _would_quantize(layer):
            _refuse_unsupported_config(getattr(layer, "config", None))
            for p in layer.parameters():
                _refuse_fsdp_param(p)
    return sum(tag_moe_layer(m) for m in layers)


def leave_unquantized(model: Any) -> int:
    """Mark every MoELayer of model (module or list of chunks) as deliberately BF16: its expert
    linears lose their tags and its forward runs unquantized while QUADS is applied (e.g. a
    reference model built before apply()). Returns the number of MoE layers marked."""
    layers = _moe_layers(model)
    for layer in layers:
        for mod in layer.modules():
            mod.__dict__.pop("_quads_target", None)
        layer._quads_state = "unquantized"
    return len(layers)


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

    from quads_megatron import _startup

    previous = STATE.config
    STATE.config = config
    if model is not None:
        try:
            tag_model(model)
        except Exception:
            STATE.config = previous
            raise
    _startup.disarm()  # the QUADS_CONFIG startup hook's deferred apply, if armed: this call replaces it
    _patch(MoELayer, "__init__", _wrap_moe_init)
    _patch(MoELayer, "forward", _wrap_moe_forward)
    for name, cls in _linear_classes().items():
        if name.startswith("TE"):
            if hasattr(cls, "_get_weight_tensors"):
                _patch(cls, "_get_weight_tensors", _wrap_get_weight_tensors)
            else:
                _patch(cls, "forward", _wrap_forward)
        else:
            _patch(cls, "forward", _wrap_forward)


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
