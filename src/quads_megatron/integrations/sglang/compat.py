"""The SGLang API differences quads_nvfp4 meets between the versions it supports (0.5.17 .. 0.5.23).

Each shim branches on what the installed SGLang has (an attribute, a module), never on its version.
What differs, 0.5.17 -> 0.5.23, among the APIs this adapter uses:

* QUANTIZATION_CHOICES (the --quantization choices list): defined in ``sglang.srt.server_args`` in
  0.5.17; defined in ``sglang.srt.arg_groups.choices`` in 0.5.23 (server_args re-exports the same list).
* MoE runner backend: 0.5.23 asks the method (``FusedMoEMethodBase.get_moe_runner_backend``, new) after
  create_moe_runner and re-derives the layer's loader and dispatcher flags from its answer; 0.5.17 has
  no such method and takes them from the server's --moe-runner-backend (its loader transposes for
  triton_kernel, pads the intermediate size for flashinfer_trtllm, its dispatcher keeps global expert
  ids for the flashinfer/cutlass runners). Both versions pad before create_weights. So the method
  accepts only the default runner (auto or triton) and no all-to-all backend: ``check_moe_backends``.
* MoeRunnerConfig: 0.5.23 adds ``gemm1_beta``, ``runner_backend``, ``no_combine_keep_router_weight``,
  ``silu_mul_keep_fp32``; ``runner_config_unsupported`` reads the fields that exist.
* QuantizationConfig.is_linear_unquantized (0.5.23 only) probes get_quant_method with a bare LinearBase.

Unchanged between the two (read in both sources): the create_weights signature and the keywords FusedMoE
passes (weight_loader, with_bias, moe_intermediate_size), FusedMoE.weight_loader(param, tensor, name,
shard_id, expert_id) and make_expert_params_mapping, the Qwen3-MoE load_weights, FusedMoE attributes
(num_experts, num_local_experts, moe_tp_size/rank, moe_ep_size/rank, use_presharded_weights,
should_fuse_routed_scaling_factor_in_topk), StandardTopKOutput / TopKOutputFormat (sglang.srt.layers.moe.topk),
StandardCombineInput (sglang.srt.layers.moe.token_dispatcher), FusedMoeWeightScaleSupported,
is_layer_skipped, set_weight_attrs, the plugin group, override_quantization_method and the loader's
get_min_capability check, the custom weight loader call ``loader(model, named_tensors)``.
"""

from __future__ import annotations

from typing import Any

from quads_megatron.errors import QuadsSglangError

#: runner backends under which FusedMoE hands quads_nvfp4 unpadded weights and local expert ids
DEFAULT_RUNNER_BACKENDS = ("auto", "triton")


def quantization_choices() -> list[str]:
    """The list behind SGLang's --quantization choices (appending to it adds a choice)."""
    try:
        from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES  # 0.5.23
    except ImportError:
        from sglang.srt.server_args import QUANTIZATION_CHOICES  # 0.5.17
    return QUANTIZATION_CHOICES


def _backend_name(backend: Any) -> str:
    return str(getattr(backend, "value", backend))


def check_moe_backends(prefix: str) -> None:
    """Refuse MoE runner / all-to-all backends that would pad, transpose or keep global expert ids
    (see the module docstring): quads_nvfp4 runs its own kernels on standard top-k with local ids."""
    from sglang.srt.layers.moe import get_moe_a2a_backend, get_moe_runner_backend

    runner, a2a = _backend_name(get_moe_runner_backend()), _backend_name(get_moe_a2a_backend())
    if runner not in DEFAULT_RUNNER_BACKENDS:
        raise QuadsSglangError(
            f"{prefix}: quads_nvfp4 runs its own MoE kernels; --moe-runner-backend {runner} is not supported "
            "(leave it at auto)"
        )
    if a2a != "none":
        raise QuadsSglangError(
            f"{prefix}: quads_nvfp4 takes the standard token dispatch; --moe-a2a-backend {a2a} is not supported"
        )


def runner_config_unsupported(config: Any) -> list[str]:
    """Names of MoeRunnerConfig settings the quads_nvfp4 experts cannot honour (gated SiLU, combined
    output, router weights applied after the experts); fields a version lacks count as unset."""
    checks = {
        "activation": lambda v: v != "silu",
        "is_gated": lambda v: not v,
        "apply_router_weight_on_input": bool,
        "no_combine": bool,
        "gemm1_alpha": lambda v: v is not None,
        "gemm1_beta": lambda v: v is not None,  # 0.5.23 only
        "gemm1_clamp_limit": lambda v: v is not None,
        "swiglu_limit": lambda v: v is not None,
    }
    defaults = {"activation": "silu", "is_gated": True}
    return [k for k, bad in checks.items() if bad(getattr(config, k, defaults.get(k)))]
