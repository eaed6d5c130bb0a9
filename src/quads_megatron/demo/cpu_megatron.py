"""Run real megatron-core MoE layers on a CPU machine (the CPU demo, the examples and the tests use this).

install_cpu_shims_for_megatron() stands in for the CUDA-only calls megatron-core makes in MoE
layers (see shared notes cpu-megatron.md). It does nothing where CUDA is available; nothing
else in quads_megatron imports this module.
"""

from __future__ import annotations

import functools
import os
import socket

import torch


def _free_port() -> int:
    """A free TCP port on 127.0.0.1 (rendezvous of a local process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CpuStreamShim:
    """No-op stand-in for torch.cuda.Stream/Event on a CPU machine."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass


def install_cpu_shims_for_megatron() -> None:
    """Shims for CUDA-only calls megatron-core makes in MoE layers (CPU tests only)."""
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _CpuStreamShim
    torch.cuda.current_stream = lambda *a, **k: _CpuStreamShim()
    torch.cuda.stream = lambda *a, **k: _CpuStreamShim()
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing's writer syncs before saving
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # 0.16.1 leaves it undefined without TE


def init_distributed(
    rank: int = 0, world_size: int = 1, port: int | None = None, ep: int = 1, backend: str = "gloo"
) -> None:
    """A process group (gloo; nccl for the GPU tests), if none yet, + megatron parallel state with
    expert parallel size ep.

    port: the rendezvous port every rank of this group uses (required when world_size > 1; a
    spawned worker must not inherit its parent's MASTER_PORT). Alone, a free port is picked.
    """
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        if port is None and world_size > 1:
            raise ValueError("init_distributed: pass the shared rendezvous port when world_size > 1")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port if port is not None else _free_port())
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)


def moe_config(num_experts: int = 4, hidden: int = 32, ffn: int = 48, topk: int = 2, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = dict(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        bias_activation_fusion=False,
        moe_grouped_gemm=False,
        params_dtype=torch.float32,
        moe_router_load_balancing_type="none",
    )
    args.update(kw)
    return TransformerConfig(**args)


def build_moe_layer(config, seed: int = 0, layer_number: int = 1):
    """A real MoELayer with SequentialMLP experts from the local (non-TE) GPT spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    mlp = spec.submodules.mlp
    if isinstance(mlp, functools.partial):  # megatron-core >= 0.19: partial(MoELayer, submodules=...)
        layer = mlp(config, layer_number=layer_number)
    else:  # <= 0.16: ModuleSpec(module=MoELayer, submodules=...)
        layer = MoELayer(config, mlp.submodules, layer_number=layer_number)
    assert isinstance(layer, MoELayer)
    layer.set_layer_number(layer_number)
    return layer
