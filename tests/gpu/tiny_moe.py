"""A small random Qwen3-MoE checkpoint (HF safetensors, BF16) for the GPU tests and engine benchmarks.

qwen3_moe_config(...) gives the config.json dict; write_checkpoint() saves random weights with transformers
(per-expert HF names, what `quads convert` and SGLang read), experts at different magnitudes so their
NVFP4 global scales differ. No tokenizer: engines run with skip_tokenizer_init and input_ids.
"""

from __future__ import annotations

import os

import torch


def qwen3_moe_config(
    hidden: int = 512,
    moe_inter: int = 256,
    experts: int = 16,
    topk: int = 4,
    layers: int = 2,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int = 64,
    vocab: int = 1024,
) -> dict:
    """config.json of a Qwen3MoeForCausalLM (every layer MoE, no shared expert, normalized top-k): the
    same dict `quads rl` serves, from its ModelSpec."""
    from quads_megatron.rl.spec import ModelSpec

    return ModelSpec(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        experts=experts, topk=topk, moe_ffn=moe_inter, vocab=vocab,
    ).hf_config()  # fmt: skip


def write_checkpoint(path: str | os.PathLike, config: dict, seed: int = 0, device: str = "cpu") -> str:
    """Random BF16 weights for config, saved by transformers at path (created); returns path."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:  # distinct global scales per expert
                p.mul_(torch.linspace(1, 4, p.shape[0], device=p.device).view(-1, *[1] * (p.dim() - 1)).to(p.dtype))
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)
