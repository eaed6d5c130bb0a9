"""The GPU tests' Megatron-Core models: quads_megatron.rl.megatron_model (moved there for `quads rl`), re-exported."""

import os

# cuBLAS is deterministic (what bit-exact comparisons between two runs need) only with a fixed
# workspace; this must be set before the first cuBLAS handle, i.e. at collection time.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from quads_megatron.rl.megatron_model import (  # noqa: E402
    EXPERT_SEQ,
    EXPERT_TE,
    build_gpt_model,
    build_moe_layer,
    fuse_qkv,
    grouped_expert_weights,
    hf_expert_weights_bf16,
    hf_non_expert_weights,
    hf_to_megatron,
    init_megatron,
    is_expert_param,
    load_hf_state,
    load_hf_weights,
    moe_layer_config,
    qwen3_transformer_config,
    te_skip_reason,
    token_logprobs,
)

__all__ = [
    "EXPERT_SEQ",
    "EXPERT_TE",
    "build_gpt_model",
    "build_moe_layer",
    "fuse_qkv",
    "grouped_expert_weights",
    "hf_expert_weights_bf16",
    "hf_non_expert_weights",
    "hf_to_megatron",
    "init_megatron",
    "is_expert_param",
    "load_hf_state",
    "load_hf_weights",
    "moe_layer_config",
    "qwen3_transformer_config",
    "te_skip_reason",
    "token_logprobs",
]
