"""SGLang adapter: the ``quads_nvfp4`` quantization method (W4A4 NVFP4 MoE experts with RAC).

Thin by design: the math lives in quads_megatron.moe_w4a4 (experts), w4a4 (RAC) and nvfp4 (the
contract); this module maps SGLang's interfaces onto it.

* register(): the ``sglang.srt.plugins`` entry point (declared in pyproject.toml, so every SGLang
  process loads it). Adds ``quads_nvfp4`` to QUANTIZATION_METHODS (first, so that its
  checkpoint override wins over ModelOpt's for ``--quantization quads_nvfp4``) and to the CLI
  choices; idempotent; refuses untested SGLang versions unless QUADS_ALLOW_UNTESTED_SGLANG=1.
* QuadsNvfp4Config: reads ModelOpt NVFP4 configs (hf_quant_config.json or config.json
  quantization_config; exclude patterns) plus the optional ``quads`` block that quads convert
  writes (rollout settings, per-layer RAC plans). QUADS_CONFIG=<yaml> overrides the rollout part.
* QuadsNvfp4MoEMethod: ModelOpt tensor names and shapes (w13_weight u8 [E, 2I, H/2], ...), so
  SGLang's own FusedMoE.weight_loader loads them; forward = moe_w4a4 (Triton on the GPU). The
  kernels read the parameters in place (scales as views, S_dec as a strided view of
  w13_weight_scale_2): there is no derived tensor that a weight update could leave stale, and
  storage never moves (CUDA-graph safe).
* Live weight sync (the custom weight loader) is in weight_sync.py.
Non-expert layers stay BF16: a checkpoint whose dense linears are NVFP4 is refused.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase, QuantizationConfig

from quads_megatron import nvfp4
from quads_megatron.config import RACConfig, RolloutConfig, load_config
from quads_megatron.errors import QuadsConfigError, QuadsSglangError, RACPlanError
from quads_megatron.nvfp4 import BLOCK_SIZE
from quads_megatron.rollout.moe_block import ExpertWeights, GemmRAC, LayerRAC, moe_w4a4
from quads_megatron.rollout.rac_plan import RACPlan

METHOD = "quads_nvfp4"
#: SGLang versions this adapter was written and tested against: [0.5.23, 0.6)
SUPPORTED_RANGE = ((0, 5, 23), (0, 6))
ALLOW_UNTESTED_ENV = "QUADS_ALLOW_UNTESTED_SGLANG"
CONFIG_ENV = "QUADS_CONFIG"

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- registration


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:3])


def check_version(version: str | None = None) -> str:
    """The installed SGLang version, or QuadsSglangError when outside SUPPORTED_RANGE."""
    if version is None:
        import sglang

        version = sglang.__version__
    lo, hi = SUPPORTED_RANGE
    if not lo <= _version_tuple(version) < hi and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise QuadsSglangError(
            f"quads_nvfp4 supports sglang >= {'.'.join(map(str, lo))}, < {'.'.join(map(str, hi))}; "
            f"found {version}. Set {ALLOW_UNTESTED_ENV}=1 to try it anyway."
        )
    return version


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: make ``quads_nvfp4`` a quantization method."""
    check_version()
    from sglang.srt.layers import quantization as q
    from sglang.srt.server_args import QUANTIZATION_CHOICES

    if q.QUANTIZATION_METHODS.get(METHOD) is not QuadsNvfp4Config:
        # first in the dict: ModelConfig asks every method to override the CLI choice, in order,
        # and ModelOpt's override would turn an NVFP4 checkpoint back into modelopt_fp4
        others = {k: v for k, v in q.QUANTIZATION_METHODS.items() if k != METHOD}
        q.QUANTIZATION_METHODS.clear()
        q.QUANTIZATION_METHODS.update({METHOD: QuadsNvfp4Config, **others})
    if METHOD not in QUANTIZATION_CHOICES:  # add_quantization_method_choices is a bare extend
        QUANTIZATION_CHOICES.append(METHOD)


def unregister() -> None:
    """Undo register() (tests, or a process that must not serve quads_nvfp4)."""
    from sglang.srt.layers import quantization as q
    from sglang.srt.server_args import QUANTIZATION_CHOICES

    q.QUANTIZATION_METHODS.pop(METHOD, None)
    while METHOD in QUANTIZATION_CHOICES:
        QUANTIZATION_CHOICES.remove(METHOD)


# ----------------------------------------------------------------------------- config


def _modelopt_fields(config: dict[str, Any]) -> tuple[str, int, list[str], dict[str, Any]]:
    """(quant_algo, group_size, exclude patterns, quads extras) from either ModelOpt layout."""
    if "quant_algo" in config:  # flat: config.json quantization_config
        algo, group = config["quant_algo"], config.get("group_size", 16)
        exclude = config.get("ignore", config.get("exclude_modules", config.get("modules_to_not_convert", [])))
        extras = config.get("quads", {})
    elif isinstance(config.get("quantization"), dict):  # nested: hf_quant_config.json
        inner = config["quantization"]
        algo, group = inner.get("quant_algo"), inner.get("group_size", 16)
        exclude = inner.get("exclude_modules", [])
        extras = config.get("quads", inner.get("quads", {}))
    else:
        raise QuadsSglangError("quads_nvfp4: no 'quant_algo' in the quantization config (expected ModelOpt NVFP4)")
    return str(algo).upper(), group, list(exclude or []), extras or {}


def _is_nvfp4_modelopt(cfg: dict[str, Any] | None) -> bool:
    if not cfg:
        return False
    if str(cfg.get("quant_method", "")).lower() in ("modelopt_fp4", METHOD):
        return True
    try:
        return _modelopt_fields(cfg)[0] == "NVFP4"
    except (QuadsSglangError, KeyError):
        return False


def _rollout_config(extras: dict[str, Any]) -> RolloutConfig:
    """QUADS_CONFIG yaml's rollout section, else the checkpoint's, else dynamic RAC (no calibration)."""
    path = os.environ.get(CONFIG_ENV)
    try:
        if path:
            return load_config(path).rollout
        if "rollout" in extras:
            return load_config({"rollout": extras["rollout"]}).rollout
    except QuadsConfigError as e:
        raise QuadsSglangError(f"quads_nvfp4 rollout config ({path or 'checkpoint quads.rollout'}): {e}") from e
    return RolloutConfig(rac=RACConfig(selection="dynamic"))


class QuadsNvfp4Config(QuantizationConfig):
    """ModelOpt NVFP4 checkpoint + QUADS rollout settings -> quant methods per layer."""

    def __init__(
        self,
        exclude_modules: list[str],
        rollout: RolloutConfig,
        rac_plans: dict[str, dict[str, list[int]]] | None = None,
    ) -> None:
        super().__init__()
        self.exclude_modules = exclude_modules
        self.rollout = rollout
        self.rac_plans = rac_plans or {}

    @classmethod
    def get_name(cls) -> str:
        return METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # fp16 tensor cores (mma.sync); tested on sm_90

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["hf_quant_config.json"]

    def get_scaled_act_names(self) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuadsNvfp4Config:
        algo, group, exclude, extras = _modelopt_fields(config)
        if algo != "NVFP4":
            raise QuadsSglangError(f"quads_nvfp4 serves NVFP4 checkpoints; this one is quant_algo={algo!r}")
        if group != BLOCK_SIZE:
            raise QuadsSglangError(f"quads_nvfp4: NVFP4 group_size must be {BLOCK_SIZE}, got {group!r}")
        plans = extras.get("rac_plans", {})
        if not isinstance(plans, dict):
            raise QuadsSglangError("quads_nvfp4: quads.rac_plans must map layer prefixes to {w13, w2} block lists")
        return cls(exclude, _rollout_config(extras), plans)

    @classmethod
    def override_quantization_method(cls, hf_quant_config: dict | None, user_quant: str | None) -> str | None:
        """Serve ModelOpt NVFP4 checkpoints when asked (--quantization quads_nvfp4), or on our own when
        the checkpoint carries a ``quads`` block and the user named no method."""
        if not _is_nvfp4_modelopt(hf_quant_config):
            return None
        if user_quant == METHOD:
            return METHOD
        if user_quant is None and "quads" in (hf_quant_config or {}):
            return METHOD
        return None

    def is_excluded(self, prefix: str) -> bool:
        from sglang.srt.layers.quantization.utils import is_layer_skipped

        packed = getattr(self, "packed_modules_mapping", None) or {}
        return is_layer_skipped(prefix, self.exclude_modules, packed)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

        if isinstance(layer, FusedMoE):
            return None if self.is_excluded(prefix) else QuadsNvfp4MoEMethod(self, prefix)
        if isinstance(layer, LinearBase):
            if self.is_excluded(prefix):
                return UnquantizedLinearMethod()
            raise QuadsSglangError(
                f"quads_nvfp4 keeps non-expert layers in BF16, but the checkpoint quantizes {prefix!r} "
                "(not in its exclude list). Convert with `quads convert` (experts only), or serve this "
                "checkpoint with modelopt_fp4 on Blackwell."
            )
        return None

    def layer_rac(self, prefix: str, hidden: int, inter: int) -> LayerRAC:
        """RAC of this MoE layer's fc1 (K = hidden) and fc2 (K = intermediate per partition)."""
        rac = self.rollout.rac
        if rac.selection == "dynamic":
            return LayerRAC(
                GemmRAC(dynamic_channels=rac.num_channels(hidden)), GemmRAC(dynamic_channels=rac.num_channels(inter))
            )
        if not rac.enabled or rac.ratio == 0:
            return LayerRAC()
        plans = self.rac_plans.get(prefix)
        if plans is None:
            raise QuadsSglangError(
                f"quads_nvfp4: rollout.rac.selection is static but the checkpoint has no RAC plan for {prefix!r}; "
                "calibrate (examples/calibrate_rac.py) or set rollout.rac.selection: dynamic"
            )
        try:
            return LayerRAC(
                GemmRAC(RACPlan(torch.tensor(plans["w13"], dtype=torch.long), hidden)),
                GemmRAC(RACPlan(torch.tensor(plans["w2"], dtype=torch.long), inter)),
            )
        except (KeyError, RACPlanError) as e:
            raise QuadsSglangError(
                f"quads_nvfp4: bad RAC plan for {prefix!r} (hidden {hidden}, inter {inter}): {e}"
            ) from e


# ----------------------------------------------------------------------------- MoE method


class QuadsNvfp4MoEMethod(FusedMoEMethodBase):
    """FusedMoE experts in W4A4 NVFP4 with RAC (quads_megatron.moe_w4a4)."""

    def __init__(self, config: QuadsNvfp4Config, prefix: str) -> None:
        self.quant_config = config
        self.prefix = prefix
        self.moe_runner_config = None

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoeWeightScaleSupported
        from sglang.srt.utils import set_weight_attrs

        h, i = hidden_size, intermediate_size_per_partition
        if h % BLOCK_SIZE or i % BLOCK_SIZE:
            raise QuadsSglangError(
                f"{self.prefix}: hidden {h} and intermediate per partition {i} must be multiples of {BLOCK_SIZE} "
                "(NVFP4 blocks; with expert TP, intermediate / TP)"
            )
        e = layer.num_local_experts
        layer.intermediate_size_per_partition = i

        def add(name, shape, dtype, fill=None, **attrs):
            data = torch.empty(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
            p = torch.nn.Parameter(data, requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, {**extra_weight_attrs, **attrs})

        block, tensor = FusedMoeWeightScaleSupported.BLOCK.value, FusedMoeWeightScaleSupported.TENSOR.value
        add("w13_weight", (e, 2 * i, h // 2), torch.uint8)
        add("w2_weight", (e, h, i // 2), torch.uint8)
        add("w13_weight_scale", (e, 2 * i, h // BLOCK_SIZE), torch.float8_e4m3fn, quant_method=block)
        add("w2_weight_scale", (e, h, i // BLOCK_SIZE), torch.float8_e4m3fn, quant_method=block)
        add("w13_weight_scale_2", (e, 2), torch.float32, quant_method=tensor)
        add("w2_weight_scale_2", (e,), torch.float32, quant_method=tensor)
        # input scales are indexed by global expert (as ModelOpt's); used only for static activation scales
        add("w13_input_scale", (layer.num_experts, 2), torch.float32, 1.0, _sglang_require_global_experts=True)
        add("w2_input_scale", (layer.num_experts,), torch.float32, 1.0, _sglang_require_global_experts=True)
        self.rac = self.quant_config.layer_rac(self.prefix, h, i)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        c = moe_runner_config
        unsupported = {
            "activation": c.activation != "silu",
            "is_gated": not c.is_gated,
            "apply_router_weight_on_input": c.apply_router_weight_on_input,
            "gemm1_alpha": c.gemm1_alpha is not None,
            "gemm1_clamp_limit": c.gemm1_clamp_limit is not None,
            "swiglu_limit": c.swiglu_limit is not None,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise QuadsSglangError(f"{self.prefix}: quads_nvfp4 runs gated SiLU experts only; unsupported: {bad}")
        self.moe_runner_config = moe_runner_config
        self.runner = None

    def get_moe_runner_backend(self, layer: torch.nn.Module):
        return None  # a direct kernel on standard top-k with local expert ids

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        check_expert_params(layer, self.prefix)
        self.rac = self.rac.on(layer.w13_weight.device)  # plan masks on the device once

    def expert_weights(self, layer: torch.nn.Module) -> ExpertWeights:
        """Views of the layer's parameters (no copies; in-place updates are seen by the next call)."""
        return ExpertWeights(
            layer.w13_weight,
            layer.w13_weight_scale.view(torch.uint8),
            layer.w13_weight_scale_2[:, 0],
            layer.w2_weight,
            layer.w2_weight_scale.view(torch.uint8),
            layer.w2_weight_scale_2,
        )

    def static_amax(self, layer: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.quant_config.rollout.activation_scale != "static":
            return None, None
        # one static scale per GEMM: the largest calibrated input_scale over experts
        return (
            nvfp4.amax_from_input_scale(layer.w13_input_scale.amax()),
            nvfp4.amax_from_input_scale(layer.w2_input_scale.amax()),
        )

    def apply(self, layer: torch.nn.Module, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputFormat

        topk = dispatch_output.topk_output
        x = dispatch_output.hidden_states
        if topk.format != TopKOutputFormat.STANDARD or x.dtype not in (torch.bfloat16, torch.float16):
            raise QuadsSglangError(
                f"{self.prefix}: quads_nvfp4 takes BF16/FP16 hidden states with standard top-k output; got "
                f"{x.dtype} and {topk.format.name} (drop --moe-runner-backend / FP8 dispatch options)"
            )
        topk_weights, topk_ids = topk[:2]
        out = moe_w4a4(
            x,
            topk_ids,
            topk_weights,
            self.expert_weights(layer),
            self.rac,
            self.static_amax(layer),
            check=not (x.is_cuda and torch.cuda.is_current_stream_capturing()),  # no host sync in capture
        )
        factor = getattr(self.moe_runner_config, "routed_scaling_factor", None)
        if factor is not None and not getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
            out = out * factor
        return StandardCombineInput(hidden_states=out)


def check_expert_params(layer: torch.nn.Module, prefix: str = "") -> None:
    """Loaded expert tensors are servable: finite, non-negative block scales; positive global scales
    shared by gate and up (the contract's shared amax; one S_dec per expert in the fc1 GEMM)."""
    for name in ("w13_weight_scale", "w2_weight_scale"):
        s = getattr(layer, name).float()
        if not torch.isfinite(s).all() or (s < 0).any():
            raise QuadsSglangError(f"{prefix}.{name}: block scales must be finite and non-negative")
    g13, g2 = layer.w13_weight_scale_2, layer.w2_weight_scale_2
    for name, g in (("w13_weight_scale_2", g13), ("w2_weight_scale_2", g2)):
        if not torch.isfinite(g).all() or (g <= 0).any():
            raise QuadsSglangError(f"{prefix}.{name}: global scales must be finite and positive")
    if not torch.equal(g13[:, 0], g13[:, 1]):
        bad = torch.nonzero(g13[:, 0] != g13[:, 1]).flatten().tolist()
        raise QuadsSglangError(
            f"{prefix}: gate and up weight_scale_2 differ for local experts {bad[:8]}; quads_nvfp4 needs the "
            "shared gate/up amax that `quads convert` and the trainer's export produce"
        )
