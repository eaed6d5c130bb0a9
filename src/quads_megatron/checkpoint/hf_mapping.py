"""Megatron-Core GPT parameter names -> HF names, for the non-expert weights of MoE checkpoints.

Family: Qwen2-MoE / Qwen3-MoE (HF ``model.layers.N.self_attn.{q,k,v,o}_proj``, ``q_norm``/``k_norm``,
``input_layernorm``, ``post_attention_layernorm``, ``mlp.gate`` (router), ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``, dense ``mlp.{gate,up,down}_proj``; ``model.embed_tokens``, ``model.norm``,
``lm_head``). Routed experts are converted by quads_megatron.convert (NVFP4), not here.

Megatron's fused QKV weight [(nq + 2 nkv) * d, H] is grouped per KV head: for each of the nkv
groups, nq/nkv query heads, then one key head, then one value head (d rows each). Fused GLU fc1
[2F, H] is gate rows then up rows. Names are the layer-local ones (``...layers.N.<rest>``), as in a
model's state dict or a dist checkpoint read one layer at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from quads_megatron.errors import MappingError


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, cfg: dict) -> AttentionShape:
        try:
            nq = int(cfg["num_attention_heads"])
            nkv = int(cfg.get("num_key_value_heads", nq))
            d = int(cfg.get("head_dim") or cfg["hidden_size"] // nq)
        except (KeyError, TypeError, ValueError) as e:
            raise MappingError(f"HF config lacks attention sizes (num_attention_heads, hidden_size): {e}") from e
        if nq % nkv:
            raise MappingError(f"num_attention_heads {nq} is not a multiple of num_key_value_heads {nkv}")
        return cls(nq, nkv, d)


def split_qkv(w: torch.Tensor, a: AttentionShape | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron linear_qkv weight [(nq+2nkv)*d, H] (or bias [(nq+2nkv)*d]) -> HF q, k, v."""
    if a is None:
        raise MappingError("splitting linear_qkv needs the attention sizes (num_attention_heads, ...) of config.json")
    per = a.num_heads // a.num_kv_heads
    rows = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    if w.shape[0] != rows:
        raise MappingError(
            f"linear_qkv has {w.shape[0]} rows; heads {a.num_heads}/{a.num_kv_heads} x head_dim {a.head_dim} "
            f"need {rows}"
        )
    g = w.reshape(a.num_kv_heads, (per + 2) * a.head_dim, *w.shape[1:])
    q, k, v = g.split([per * a.head_dim, a.head_dim, a.head_dim], dim=1)
    return tuple(t.reshape(-1, *w.shape[1:]).clone() for t in (q, k, v))  # type: ignore[return-value]


def _halves(w: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if w.shape[0] % 2:
        raise MappingError(f"{what}: fused GLU fc1 has an odd row count {w.shape[0]}")
    h = w.shape[0] // 2
    return w[:h].clone(), w[h:].clone()


_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}
_SIMPLE = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
_LAYER = re.compile(r"^(?:module\.)*(?:decoder\.)?layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
EXPERT_PARAM = re.compile(r"\.mlp\.experts\.")


def megatron_to_hf(
    name: str, t: torch.Tensor, attn: AttentionShape | None, hf_prefix: str = "model.layers", layer_offset: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """One Megatron non-expert tensor -> its HF tensors (empty for ``_extra_state``).

    Raises MappingError for routed-expert tensors (converted elsewhere) and unknown names.
    """
    bare = re.sub(r"^(?:module\.)+", "", name)
    if bare.endswith("_extra_state") or "._extra_state" in bare:
        return []
    if bare in _GLOBAL:
        return [(_GLOBAL[bare], t)]
    m = _LAYER.match(bare)
    if m is None:
        raise MappingError(f"{name}: not a Megatron GPT parameter this mapping knows")
    base, rest = f"{hf_prefix}.{int(m['layer']) + layer_offset}", m["rest"]
    if EXPERT_PARAM.search("." + rest):
        raise MappingError(f"{name}: a routed-expert tensor (converted to NVFP4, not mapped here)")
    if rest in _SIMPLE:
        return [(f"{base}.{_SIMPLE[rest]}", t)]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = split_qkv(t, attn)
        return [(f"{base}.self_attn.{p}_proj.{kind}", x) for p, x in zip("qkv", (q, k, v), strict=True)]
    if rest in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
        gate, up = _halves(t, name)
        mod = "mlp" if rest.startswith("mlp.linear") else "mlp.shared_expert"
        return [(f"{base}.{mod}.gate_proj.weight", gate), (f"{base}.{mod}.up_proj.weight", up)]
    raise MappingError(f"{name}: no HF (Qwen2/Qwen3-MoE family) name for Megatron '{rest}'")
