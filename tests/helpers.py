"""Test helpers: random MoE state for expert-parallel tests, a free port, and HF<->Megatron QKV fusing."""

from __future__ import annotations

import socket

import torch

from quads_megatron.checkpoint.hf_mapping import AttentionShape


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (rendezvous of a local process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_expert_state(num_experts: int, hidden: int, ffn: int, seed: int = 0) -> dict:
    """Global weights of one MoE layer with GLU experts: router [E, H], fc1 E x [2F, H], fc2 E x [H, F]
    (experts at different scales, so their global NVFP4 scales differ), for expert-parallel tests."""
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(num_experts, hidden, generator=g) * 0.5,
        "fc1": [torch.randn(2 * ffn, hidden, generator=g) * 0.05 * (e + 1) for e in range(num_experts)],
        "fc2": [torch.randn(hidden, ffn, generator=g) * 0.05 for _ in range(num_experts)],
    }


def load_expert_state(layer, state: dict, ep_rank: int = 0) -> None:
    """Copy random_expert_state's router and this EP rank's experts (global index ep_rank * local + i)
    into a SequentialMLP MoE layer built by build_moe_layer."""
    local = len(layer.experts.local_experts)
    with torch.no_grad():
        layer.router.weight.copy_(state["router"])
        for i, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(state["fc1"][ep_rank * local + i])
            expert.linear_fc2.weight.copy_(state["fc2"][ep_rank * local + i])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttentionShape) -> torch.Tensor:
    """HF q, k, v -> Megatron linear_qkv (inverse of split_qkv)."""
    per = a.num_heads // a.num_kv_heads
    rest = q.shape[1:]
    parts = (
        q.reshape(a.num_kv_heads, per * a.head_dim, *rest),
        k.reshape(a.num_kv_heads, a.head_dim, *rest),
        v.reshape(a.num_kv_heads, a.head_dim, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)
