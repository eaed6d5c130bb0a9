"""SGLang adapter: the ``quads_nvfp4`` quantization method (W4A4 NVFP4 MoE experts with RAC).

Thin by design: the math lives in quads_megatron.moe_w4a4 (experts), w4a4 (RAC) and nvfp4 (the
contract); this module maps SGLang's interfaces onto it.

* register(): the ``sglang.srt.plugins`` entry point (declared in pyproject.toml, so every SGLang
  process loads it). Adds ``quads_nvfp4`` to QUANTIZATION_METHODS (first, so that its
  checkpoint override wins over ModelOpt's for ``--quantization quads_nvfp4``) and to the CLI
  choices; idempotent; refuses SGLang outside sglang_versions.SUPPORTED_RANGE unless
  QUADS_ALLOW_UNTESTED_SGLANG=1.
  What differs between the supported SGLang versions is handled in compat.py.
* QuadsNvfp4Config: reads ModelOpt NVFP4 configs (hf_quant_config.json or config.json
  quantization_config; exclude patterns) plus the optional ``quads`` block that quads convert
  writes (rollout settings, per-layer RAC plans, the NVFP4 variant ``nvfp4``). QUADS_CONFIG=<yaml>
  overrides the rollout part; its nvfp4 section must match the checkpoint's (the weights were quantized
  with it), and the activations are quantized with that variant's activation recipe.
* QuadsNvfp4MoEMethod: ModelOpt tensor names and shapes (w13_weight u8 [E, 2I, H/2], ...), so
  SGLang's own FusedMoE.weight_loader loads them; forward = moe_w4a4 (Triton on the GPU). The
  kernels read the parameters in place (scales as views, S_dec as a strided view of
  w13_weight_scale_2): there is no derived tensor that a weight update could leave stale, and
  storage never moves (CUDA-graph safe). Once loaded, codes and scales are permuted in place into the
  GEMMs' tiled order where the shapes allow (rollout.weight_layout; tiled_layout.py keeps every later
  write row-major).
* Live weight sync (the custom weight loader) is in weight_sync.py.
Non-expert layers stay BF16: a checkpoint whose dense linears are NVFP4 is refused.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase, QuantizationConfig

from quads_megatron import nvfp4
from quads_megatron.config import NVFP4Config, RACConfig, RolloutConfig, load_config
from quads_megatron.errors import QuadsConfigError, QuadsSglangError, RACPlanError
from quads_megatron.integrations.sglang import compat, tiled_layout
from quads_megatron.integrations.sglang_versions import check_version
from quads_megatron.kernels import weight_layout
from quads_megatron.nvfp4 import BLOCK_SIZE
from quads_megatron.rollout.moe_block import ExpertWeights, GemmRAC, LayerRAC, moe_w4a4
from quads_megatron.rollout.rac_plan import RACPlan

METHOD = "quads_nvfp4"
#: sm_90: the kernels convert FP8 e4m3 scales (sm_89+) and the fast GEMM is Hopper wgmma; tested on sm_90
MIN_CAPABILITY = 90
CONFIG_ENV = "QUADS_CONFIG"

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- registration


def _device_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device, None without one."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def check_device(capability: tuple[int, int] | None = None) -> None:
    """Refuse a CUDA GPU below MIN_CAPABILITY with the reason (SGLang's own check only names the
    numbers). capability: (major, minor), default the current device; None (no CUDA) passes."""
    cap = _device_capability() if capability is None else capability
    if cap is None or cap[0] * 10 + cap[1] >= MIN_CAPABILITY:
        return
    raise QuadsSglangError(
        f"quads_nvfp4 needs an sm_{MIN_CAPABILITY} (Hopper) or newer GPU, this one is sm_{cap[0]}{cap[1]}: its "
        "kernels convert FP8 e4m3 block scales in hardware (sm_89+) and its GEMM uses Hopper wgmma; "
        "it is tested on sm_90 only"
    )


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: make ``quads_nvfp4`` a quantization method."""
    check_version()
    from sglang.srt.layers import quantization as q

    choices = compat.quantization_choices()
    if q.QUANTIZATION_METHODS.get(METHOD) is not QuadsNvfp4Config:
        # first in the dict: ModelConfig asks every method to override the CLI choice, in order,
        # and ModelOpt's override would turn an NVFP4 checkpoint back into modelopt_fp4
        others = {k: v for k, v in q.QUANTIZATION_METHODS.items() if k != METHOD}
        q.QUANTIZATION_METHODS.clear()
        q.QUANTIZATION_METHODS.update({METHOD: QuadsNvfp4Config, **others})
    if METHOD not in choices:  # add_quantization_method_choices is a bare extend
        choices.append(METHOD)


def unregister() -> None:
    """Undo register() (tests, or a process that must not serve quads_nvfp4)."""
    from sglang.srt.layers import quantization as q

    choices = compat.quantization_choices()
    q.QUANTIZATION_METHODS.pop(METHOD, None)
    while METHOD in choices:
        choices.remove(METHOD)


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


def _rollout_config(extras: dict[str, Any]) -> tuple[RolloutConfig, str]:
    """(rollout, where it came from): QUADS_CONFIG yaml's rollout section, else the checkpoint's, else
    dynamic RAC (no calibration)."""
    path = os.environ.get(CONFIG_ENV)
    source = f"{CONFIG_ENV}={path}" if path else "checkpoint quads.rollout"
    try:
        if path:
            return load_config(path).rollout, source
        if "rollout" in extras:
            return load_config({"rollout": extras["rollout"]}).rollout, source
    except QuadsConfigError as e:
        raise QuadsSglangError(f"quads_nvfp4 rollout config ({source}): {e}") from e
    return RolloutConfig(rac=RACConfig(selection="dynamic")), "default"


def _nvfp4_config(extras: dict[str, Any]) -> NVFP4Config:
    """The checkpoint's NVFP4 variant (quads.nvfp4; absent: plain NVFP4, as every ModelOpt checkpoint),
    validated like the YAML's nvfp4 section; a QUADS_CONFIG yaml must name the same one."""
    record = extras.get("nvfp4")
    try:
        cfg = NVFP4Config() if record is None else load_config({"nvfp4": record}).nvfp4
    except QuadsConfigError as e:
        raise QuadsSglangError(f"quads_nvfp4: the checkpoint's NVFP4 variant (quads.nvfp4) is not served: {e}") from e
    path = os.environ.get(CONFIG_ENV)
    if path:
        try:
            mine = load_config(path).nvfp4
        except QuadsConfigError as e:
            raise QuadsSglangError(f"quads_nvfp4 config ({CONFIG_ENV}={path}): {e}") from e
        if mine.weights != cfg.weights or mine.activations != cfg.activations:
            raise QuadsSglangError(
                f"quads_nvfp4: {CONFIG_ENV}={path} has nvfp4 {mine.to_dict()}, the checkpoint was quantized with "
                f"{cfg.to_dict()}: trainer and rollout would make different numbers; convert with the same "
                "QUADS config (quads convert --quads-config) or fix the yaml"
            )
    return cfg


def _needs_plans(rollout: RolloutConfig) -> bool:
    rac = rollout.rac
    return rac.selection == "static" and rac.enabled and rac.ratio > 0


def _check_plans(plans: Any) -> dict[str, dict[str, list[int]]]:
    """quads.rac_plans is {MoE layer prefix: {"w13": [block, ...], "w2": [...]}} with unique
    non-negative int blocks (their range is checked per layer, in layer_rac)."""
    if not isinstance(plans, dict):
        raise QuadsSglangError("quads_nvfp4: quads.rac_plans must map MoE layer prefixes to {w13, w2} block lists")
    for prefix, plan in plans.items():
        if not isinstance(plan, dict) or set(plan) != {"w13", "w2"}:
            got = sorted(plan) if isinstance(plan, dict) else type(plan).__name__
            raise QuadsSglangError(
                f"quads_nvfp4: RAC plan for {prefix!r} must have exactly w13 and w2 lists, got {got}"
            )
        for gemm, blocks in plan.items():
            ok = isinstance(blocks, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)
            if not ok or any(b < 0 for b in blocks) or len(set(blocks)) != len(blocks):
                raise QuadsSglangError(
                    f"quads_nvfp4: RAC plan {prefix!r} {gemm} must be a list of unique non-negative block indices"
                )
    return plans


class QuadsNvfp4Config(QuantizationConfig):
    """ModelOpt NVFP4 checkpoint + QUADS rollout settings -> quant methods per layer."""

    def __init__(
        self,
        exclude_modules: list[str],
        rollout: RolloutConfig,
        rac_plans: dict[str, dict[str, list[int]]] | None = None,
        rollout_source: str = "default",
        nvfp4_config: NVFP4Config | None = None,
    ) -> None:
        super().__init__()
        self.exclude_modules = exclude_modules
        self.rollout = rollout
        self.rac_plans = rac_plans or {}
        self.rollout_source = rollout_source
        self.nvfp4_config = nvfp4_config or NVFP4Config()

    @classmethod
    def get_name(cls) -> str:
        return METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY  # why: check_device, which from_config runs first with a clear message

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
        check_device()
        nvfp4_config = _nvfp4_config(extras)
        plans = _check_plans(extras.get("rac_plans", {}))
        rollout, source = _rollout_config(extras)
        if _needs_plans(rollout) and not plans:
            raise QuadsSglangError(
                f"quads_nvfp4: {source} asks for static RAC (rollout.rac.selection: static) but the checkpoint "
                "has no RAC plans; calibrate and convert with --rac-plans, or set rollout.rac.selection: dynamic"
            )
        producer = config.get("producer")
        if (
            rollout.activation_scale == "static"
            and isinstance(producer, dict)
            and producer.get("name") == "quads_megatron"
            and producer.get("input_scale") == "default"
        ):
            raise QuadsSglangError(
                f"quads_nvfp4: {source} asks for static activation scales (rollout.activation_scale: static) but "
                "the checkpoint's input_scale values are the uncalibrated default (converted without --input-amax); "
                "calibrate and convert with --input-amax, or set rollout.activation_scale: dynamic"
            )
        if not nvfp4_config.is_default:
            logger.info(
                "quads_nvfp4: NVFP4 variant %s (weights %s, activations %s)",
                nvfp4_config.to_dict(),
                nvfp4_config.weights,
                nvfp4_config.activations,
            )
        return cls(exclude, rollout, plans, source, nvfp4_config)

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
        """RAC of this MoE layer's fc1 (K = hidden) and fc2 (K = intermediate per partition). A static
        plan must exist for the layer, fit K and compensate the channels the rollout ratio asks for."""
        rac = self.rollout.rac
        if rac.selection == "dynamic":
            return LayerRAC(
                GemmRAC(dynamic_channels=rac.num_channels(hidden)), GemmRAC(dynamic_channels=rac.num_channels(inter))
            )
        if not _needs_plans(self.rollout):
            return LayerRAC()
        plans = self.rac_plans.get(prefix)
        if plans is None:
            raise QuadsSglangError(
                f"quads_nvfp4: rollout.rac.selection is static ({self.rollout_source}) but the checkpoint has no "
                f"RAC plan for {prefix!r}; calibrate (examples/calibrate_rac.py) or set rollout.rac.selection: dynamic"
            )
        gemms = []
        for gemm, k in (("w13", hidden), ("w2", inter)):
            try:
                plan = RACPlan(torch.tensor(plans[gemm], dtype=torch.long), k)
            except RACPlanError as e:
                raise QuadsSglangError(f"quads_nvfp4: bad RAC plan for {prefix!r} {gemm} (K={k}): {e}") from e
            if plan.num_channels != rac.num_channels(k):
                raise QuadsSglangError(
                    f"quads_nvfp4: RAC plan for {prefix!r} {gemm} compensates {plan.num_channels} of K={k} channels; "
                    f"rollout.rac.ratio {rac.ratio} ({self.rollout_source}) asks for {rac.num_channels(k)}: "
                    "calibrate for this ratio or use the ratio the plans were made for"
                )
            gemms.append(GemmRAC(plan))
        return LayerRAC(*gemms)


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

        compat.check_moe_backends(self.prefix)
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
        nan = float("nan")  # scales the checkpoint does not fill stay NaN: check_expert_params refuses them
        add("w13_weight", (e, 2 * i, h // 2), torch.uint8)
        add("w2_weight", (e, h, i // 2), torch.uint8)
        add("w13_weight_scale", (e, 2 * i, h // BLOCK_SIZE), torch.float8_e4m3fn, nan, quant_method=block)
        add("w2_weight_scale", (e, h, i // BLOCK_SIZE), torch.float8_e4m3fn, nan, quant_method=block)
        add("w13_weight_scale_2", (e, 2), torch.float32, nan, quant_method=tensor)
        add("w2_weight_scale_2", (e,), torch.float32, nan, quant_method=tensor)
        # input scales are indexed by global expert (as ModelOpt's); used only for static activation
        # scales. 0 marks "not in the checkpoint" (a loaded ModelOpt input_scale is positive)
        add("w13_input_scale", (layer.num_experts, 2), torch.float32, 0.0, _sglang_require_global_experts=True)
        add("w2_input_scale", (layer.num_experts,), torch.float32, 0.0, _sglang_require_global_experts=True)
        self.rac = self.quant_config.layer_rac(self.prefix, h, i)
        self.tiled = self._wants_tiled(layer, h, i)
        if self.tiled:
            tiled_layout.guard_loader(layer)

    def _wants_tiled(self, layer: torch.nn.Module, hidden: int, inter: int) -> bool:
        """Whether this layer's weights are tiled once loaded (rollout.weight_layout; see tiled_layout)."""
        choice = self.quant_config.rollout.weight_layout
        if choice == "row_major":
            return False
        why = tiled_layout.tileable(hidden, inter) or tiled_layout.loader_hook_missing(layer)
        if why and choice == "tiled":
            raise QuadsSglangError(
                f"{self.prefix}: rollout.weight_layout is tiled ({self.quant_config.rollout_source}) but {why}; "
                "set rollout.weight_layout: auto or row_major"
            )
        return why is None

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config) -> None:
        bad = compat.runner_config_unsupported(moe_runner_config)
        if bad:
            raise QuadsSglangError(
                f"{self.prefix}: quads_nvfp4 runs gated SiLU experts with a combined output only; unsupported: {bad}"
            )
        self.moe_runner_config = moe_runner_config
        self.runner = None

    def get_moe_runner_backend(self, layer: torch.nn.Module):
        return None  # a direct kernel on standard top-k with local expert ids (asked by 0.5.23 only)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        check_expert_params(layer, self.prefix)
        if self.quant_config.rollout.activation_scale == "static":
            check_input_scales(layer, self.prefix, self.quant_config.rollout_source)
        self.rac = self.rac.on(layer.w13_weight.device)  # plan masks on the device once
        if self.tiled:  # once: update_weights_from_disk calls this again on a layer kept tiled
            tiled_layout.set_tiled(layer, True)

    def expert_weights(self, layer: torch.nn.Module) -> ExpertWeights:
        """Views of the layer's parameters (no copies; in-place updates are seen by the next call): row-major
        [E, N, K/2] / [E, N, K/16], or the same storage as weight_layout's tiled 5-D shapes."""
        w13, s13 = layer.w13_weight, layer.w13_weight_scale.view(torch.uint8)
        w2, s2 = layer.w2_weight, layer.w2_weight_scale.view(torch.uint8)
        if tiled_layout.is_tiled(layer):
            w13, w2 = (weight_layout.tiled_view(w, weight_layout.CODE_CHUNK_BYTES) for w in (w13, w2))
            s13, s2 = (weight_layout.tiled_view(s, weight_layout.SCALE_CHUNK_BYTES) for s in (s13, s2))
        return ExpertWeights(w13, s13, layer.w13_weight_scale_2[:, 0], w2, s2, layer.w2_weight_scale_2)

    def static_amax(self, layer: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.quant_config.rollout.activation_scale != "static":
            return None, None
        # one static scale per GEMM: the largest calibrated input_scale over experts (S_dec of the
        # activations' recipe: amax / (6 * e4m3_max))
        recipe = self.quant_config.nvfp4_config.activations
        return (
            nvfp4.amax_from_input_scale(layer.w13_input_scale.amax(), recipe),
            nvfp4.amax_from_input_scale(layer.w2_input_scale.amax(), recipe),
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
            recipe=self.quant_config.nvfp4_config.activations,
        )
        factor = getattr(self.moe_runner_config, "routed_scaling_factor", None)
        if factor is not None and not getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
            out = out * factor
        return StandardCombineInput(hidden_states=out)


def check_expert_params(layer: torch.nn.Module, prefix: str = "") -> None:
    """Loaded expert tensors are servable: finite, non-negative block scales; positive global scales
    shared by gate and up (the contract's shared amax; one S_dec per expert in the fc1 GEMM). Scales
    the checkpoint lacks are still NaN (create_weights) and refused here, naming the local expert."""
    for name in ("w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2", "w2_weight_scale_2"):
        s = getattr(layer, name).float()
        s = s.reshape(s.shape[0], -1)
        ok = torch.isfinite(s) & ((s >= 0) if name.endswith("_scale") else (s > 0))
        bad = torch.nonzero(~ok.all(dim=1)).flatten().tolist()
        if bad:
            what = "block scales must be finite and >= 0" if name.endswith("_scale") else "must be finite and > 0"
            hint = " (NaN: not in the checkpoint?)" if bool(torch.isnan(s[bad]).any()) else ""
            raise QuadsSglangError(f"{prefix}.{name}: {what}, not so for local experts {bad[:8]}{hint}")
    g13 = layer.w13_weight_scale_2
    if not torch.equal(g13[:, 0], g13[:, 1]):
        bad = torch.nonzero(g13[:, 0] != g13[:, 1]).flatten().tolist()
        raise QuadsSglangError(
            f"{prefix}: gate and up weight_scale_2 differ for local experts {bad[:8]}; quads_nvfp4 needs the "
            "shared gate/up amax that `quads convert` and the trainer's export produce"
        )


def check_input_scales(layer: torch.nn.Module, prefix: str = "", source: str = "") -> None:
    """Static activation scales need a calibrated, finite, positive input_scale for every expert (the
    checkpoint's; 0 = absent): the GEMMs quantize activations with the largest of them."""
    for name in ("w13_input_scale", "w2_input_scale"):
        s = getattr(layer, name).float().reshape(getattr(layer, name).shape[0], -1)
        bad = torch.nonzero(~(torch.isfinite(s) & (s > 0)).all(dim=1)).flatten().tolist()
        if bad:
            raise QuadsSglangError(
                f"{prefix}.{name}: rollout.activation_scale is static ({source or 'config'}) but {len(bad)} experts "
                f"(first: {bad[0]}, value {s[bad[0]].tolist()}) have no finite positive input_scale; calibrate "
                "(input_amax) and convert again, or set rollout.activation_scale: dynamic"
            )
