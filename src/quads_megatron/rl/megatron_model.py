"""Megatron-Core models for `quads rl` and the GPU tests: TE MoE layers, a GPTModel matching a Qwen3-MoE HF config.

* init_megatron(): a one-process world (nccl on CUDA, gloo on CPU) with megatron parallel state.
* moe_layer_config / build_moe_layer: one MoELayer from the Transformer Engine GPT spec (TEGroupedMLP
  experts, TE linears for shared experts).
* qwen3_transformer_config / build_gpt_model: the GPTModel of a Qwen3-MoE config.json dict (RMSNorm,
  QK layernorm, RoPE base, softmax top-k routing renormalized over the chosen experts, SwiGLU experts,
  no biases, untied embeddings).
* hf_to_megatron / load_hf_weights: HF (per-expert Qwen3-MoE names) -> Megatron parameters, for the TE
  spec (fused layernorm weights, grouped weight{i}) and the local spec (SequentialMLP) alike. The
  library's checkpoint.hf_mapping.megatron_to_hf is the other direction; tests check the round trip.
* hf_expert_weights_bf16 / hf_non_expert_weights: what a live sync sends, named as HF names.
* token_logprobs: log p(ids[t] | ids[:t]) from a GPTModel forward, fp32.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping

import torch

EXPERT_SEQ = re.compile(r"^(?:decoder\.)?layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_(fc1|fc2)\.weight$")
EXPERT_TE = re.compile(r"^(?:decoder\.)?layers\.(\d+)\.mlp\.experts\.linear_(fc1|fc2)\.weight(\d+)$")
_LAYER = re.compile(r"^(?:decoder\.)?layers\.(\d+)\.(.+)$")


# ----------------------------------------------------------------------------- environment


def te_skip_reason() -> str | None:
    """Why the Transformer Engine tests cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (H200 run)"
    try:
        import transformer_engine  # noqa: F401  (torch is imported first: TE's core needs its NCCL)
        import transformer_engine.pytorch  # noqa: F401
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception as e:  # ImportError, or a TE build that does not load
        return f"needs Transformer Engine with megatron-core's TE extension ({type(e).__name__}: {e})"
    if getattr(te_ext, "TEColumnParallelGroupedLinear", None) is None:
        return "megatron-core's TE extension has no TEColumnParallelGroupedLinear (TE too old)"
    return None


def init_megatron(seed: int = 1234) -> None:
    """One-process world + megatron parallel state (EP=TP=1) and its CUDA RNG tracker on a GPU."""
    from megatron.core import parallel_state

    from quads_megatron.demo.cpu_megatron import init_distributed, install_cpu_shims_for_megatron

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        if torch.distributed.is_initialized() and torch.distributed.get_backend() != "nccl":
            parallel_state.destroy_model_parallel()  # a gloo world from CPU tests: CUDA tensors need nccl
            torch.distributed.destroy_process_group()
        init_distributed(backend="nccl")
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        install_cpu_shims_for_megatron()
        init_distributed()


# ----------------------------------------------------------------------------- one MoE layer


def _swiglu_moe_args(dtype: torch.dtype) -> dict:
    """TransformerConfig fields both configs here share: bias-free SwiGLU experts on the grouped GEMM,
    all-to-all dispatch, no load balancing, no dropout, dtype."""
    return dict(
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=True,
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )


def moe_layer_config(
    experts: int = 8,
    hidden: int = 256,
    ffn: int = 128,
    topk: int = 2,
    shared_ffn: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    **kw,
):
    """TransformerConfig of one SwiGLU MoE layer, bias-free, dropless, no aux loss; kw overrides."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = dict(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_shared_expert_intermediate_size=shared_ffn,
        **_swiglu_moe_args(dtype),
    )
    args.update(kw)
    return TransformerConfig(**args)


def build_moe_layer(config, layer_number: int = 1):
    """A real MoELayer from megatron-core's Transformer Engine GPT layer spec: TEGroupedMLP experts
    (config.moe_grouped_gemm), TE linears for the shared experts; on the current CUDA device."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer_spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm
    )
    mlp = layer_spec.submodules.mlp
    if isinstance(mlp, functools.partial):  # megatron-core >= 0.19: partial(MoELayer, submodules=...)
        layer = mlp(config, layer_number=layer_number)
    else:  # <= 0.16: ModuleSpec(module=MoELayer, submodules=...)
        layer = MoELayer(config, mlp.submodules, layer_number=layer_number)
    assert isinstance(layer, MoELayer)
    layer.set_layer_number(layer_number)
    return layer.cuda()


def grouped_expert_weights(layer, linear: str) -> list[torch.nn.Parameter]:
    """TEGroupedMLP's per-expert weight{i} of linear_fc1 / linear_fc2, in expert order."""
    mod = getattr(layer.experts, f"linear_{linear}")
    return [getattr(mod, f"weight{i}") for i in range(mod.num_gemms)]


# ----------------------------------------------------------------------------- Qwen3-MoE GPTModel


def qwen3_transformer_config(hf: Mapping, dtype: torch.dtype = torch.bfloat16, **kw):
    """Megatron TransformerConfig with the architecture of a Qwen3-MoE config.json (every layer MoE).

    Routing: Qwen3 softmaxes all logits, takes the top k and (norm_topk_prob) divides by their sum,
    which is a softmax over the k largest logits: moe_router_pre_softmax=False with the softmax score
    function and no scaling factor. A config with norm_topk_prob=False is refused (it would need
    pre-softmax routing without renormalization).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not hf.get("norm_topk_prob", False):
        raise ValueError("qwen3_transformer_config: only norm_topk_prob=True (renormalized top-k) is mapped")
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ValueError("qwen3_transformer_config: every layer must be MoE (mlp_only_layers=[], sparse step 1)")
    if hf.get("tie_word_embeddings", False):
        raise ValueError("qwen3_transformer_config: tied embeddings are not mapped")
    args = dict(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=int(hf["num_attention_heads"]),
        num_query_groups=int(hf["num_key_value_heads"]),
        kv_channels=int(hf["head_dim"]),
        ffn_hidden_size=int(hf["intermediate_size"]),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        num_moe_experts=int(hf["num_experts"]),
        moe_router_topk=int(hf["num_experts_per_tok"]),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_topk_scaling_factor=None,
        moe_aux_loss_coeff=0.0,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf["rms_norm_eps"]),
        qk_layernorm=True,
        add_qkv_bias=False,
        apply_rope_fusion=False,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        **_swiglu_moe_args(dtype),
    )
    args.update(kw)
    return TransformerConfig(**args)


def build_gpt_model(hf: Mapping, spec: str = "te", dtype: torch.dtype = torch.bfloat16, device: str = "cuda", **kw):
    """GPTModel for a Qwen3-MoE config.json dict: 'te' spec (TEGroupedMLP) or 'local' (SequentialMLP, CPU)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    config = qwen3_transformer_config(hf, dtype, **kw)
    if spec == "te":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=True, qk_layernorm=True
        )
    else:
        config.moe_grouped_gemm = False
        layer_spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
        )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=int(hf["vocab_size"]),
        max_sequence_length=int(hf["max_position_embeddings"]),
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=int(hf["rope_theta"]),
    )
    return model.to(device)


# ----------------------------------------------------------------------------- HF -> Megatron


def load_hf_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint directory (one file or an index)."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    return state


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """HF q [nq*d, H], k/v [nkv*d, H] -> Megatron linear_qkv [(nq+2nkv)*d, H], grouped per KV head:
    for each KV group, its nq/nkv query heads, then its key head, then its value head."""
    d = k.shape[0] // kv_heads
    per = heads // kv_heads
    groups = [
        torch.cat([q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]])
        for g in range(kv_heads)
    ]
    return torch.cat(groups)


def _hf(hf: Mapping[str, torch.Tensor], name: str, what: str) -> torch.Tensor:
    if name not in hf:
        raise KeyError(f"{what}: the HF checkpoint has no {name}")
    return hf[name]


_LAYER_SIMPLE = {  # Megatron layer-local name -> HF layer-local name (tensor unchanged)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def hf_to_megatron(name: str, hf: Mapping[str, torch.Tensor], hf_config: Mapping) -> torch.Tensor:
    """The value of Megatron parameter `name` (GPTModel names, TE or local spec) from HF tensors.

    Experts: TE weight{i} / SequentialMLP local_experts.{i} fc1 = [gate_i; up_i] (gate rows first, as
    Megatron's GLU splits fc1's output), fc2 = down_i. Raises KeyError for a name it does not know.
    """
    if name in _GLOBAL:
        return _hf(hf, _GLOBAL[name], name)
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"{name}: not a Megatron GPTModel parameter of the Qwen3-MoE mapping")
    layer, rest = int(m[1]), m[2]
    base = f"model.layers.{layer}"
    if rest in _LAYER_SIMPLE:
        return _hf(hf, f"{base}.{_LAYER_SIMPLE[rest]}", name)
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = (_hf(hf, f"{base}.self_attn.{p}_proj.weight", name) for p in "qkv")
        return fuse_qkv(q, k, v, int(hf_config["num_attention_heads"]), int(hf_config["num_key_value_heads"]))
    e = EXPERT_TE.match(name) or EXPERT_SEQ.match(name)
    if e is not None:
        fc, idx = (e[2], int(e[3])) if e.re is EXPERT_TE else (e[3], int(e[2]))
        expert = f"{base}.mlp.experts.{idx}"
        if fc == "fc2":
            return _hf(hf, f"{expert}.down_proj.weight", name)
        return torch.cat([_hf(hf, f"{expert}.gate_proj.weight", name), _hf(hf, f"{expert}.up_proj.weight", name)])
    raise KeyError(f"{name}: no Qwen3-MoE HF source for Megatron '{rest}'")


def load_hf_weights(model: torch.nn.Module, hf: Mapping[str, torch.Tensor], hf_config: Mapping) -> list[str]:
    """Copy every parameter of model from the HF tensors (cast to the parameter's dtype, in place);
    returns the HF names read. Raises KeyError if a parameter has no source or a shape differs."""
    used: set[str] = set()
    tracking = _Tracking(hf, used)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = hf_to_megatron(name, tracking, hf_config)
            if tuple(t.shape) != tuple(p.shape):
                raise KeyError(f"{name}: HF value has shape {tuple(t.shape)}, the parameter {tuple(p.shape)}")
            p.copy_(t.to(device=p.device, dtype=p.dtype))
    return sorted(used)


class _Tracking(Mapping):
    """A read-only view of the HF tensors that records which names were read."""

    def __init__(self, hf: Mapping[str, torch.Tensor], used: set[str]) -> None:
        self._hf, self._used = hf, used

    def __getitem__(self, key: str) -> torch.Tensor:
        t = self._hf[key]
        self._used.add(key)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._hf)

    def __len__(self) -> int:
        return len(self._hf)


# ----------------------------------------------------------------------------- Megatron -> HF (sync)


def is_expert_param(name: str) -> bool:
    return bool(EXPERT_TE.match(_bare(name)) or EXPERT_SEQ.match(_bare(name)))


def _bare(name: str) -> str:
    return re.sub(r"^(?:module\.)+", "", name)


def hf_expert_weights_bf16(
    named_params: Iterable[tuple[str, torch.Tensor]], num_local_experts: int, ep_rank: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron routed-expert weights -> HF-named BF16 gate_proj / up_proj / down_proj (what the
    engine's loader quantizes with the contract): fc1 rows split in gate then up halves."""
    for name, w in named_params:
        bare = _bare(name)
        m = EXPERT_TE.match(bare) or EXPERT_SEQ.match(bare)
        if m is None:
            continue
        layer = int(m[1])
        fc, idx = (m[2], int(m[3])) if m.re is EXPERT_TE else (m[3], int(m[2]))
        base = f"model.layers.{layer}.mlp.experts.{ep_rank * num_local_experts + idx}"
        w = w.detach()
        if fc == "fc2":
            yield f"{base}.down_proj.weight", w.contiguous()
        else:
            half = w.shape[0] // 2
            yield f"{base}.gate_proj.weight", w[:half].contiguous()
            yield f"{base}.up_proj.weight", w[half:].contiguous()


def hf_non_expert_weights(
    named_params: Iterable[tuple[str, torch.Tensor]], hf_config: Mapping
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every non-expert Megatron parameter as HF-named tensors, through the library's megatron_to_hf."""
    from quads_megatron.checkpoint.hf_mapping import AttentionShape, megatron_to_hf

    attn = AttentionShape.from_hf_config(dict(hf_config))
    for name, p in named_params:
        if not is_expert_param(name):
            yield from megatron_to_hf(name, p.detach(), attn)


# ----------------------------------------------------------------------------- logprobs


def token_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 [len(ids) - 1]: log p(ids[t] | ids[:t]) for t >= 1, from one causal forward of model."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    pos = torch.arange(len(ids), device=device).unsqueeze(0)
    mask = None  # causal from the layer spec; megatron's CPU fallback builds its default mask on CUDA
    if device.type == "cpu":
        mask = torch.triu(torch.ones(len(ids), len(ids), dtype=torch.bool), diagonal=1)[None, None]
    logits = model(x, pos, attention_mask=mask)  # [1, S, V]
    lp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    return lp.gather(-1, x[0, 1:, None])[:, 0]
