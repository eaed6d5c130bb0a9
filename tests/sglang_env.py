"""The SGLang test environment shared by the quads_nvfp4 test modules: a tiny Qwen3-MoE checkpoint
(BF16 and its `quads convert` output), SGLang's process state on this CPU, models built by SGLang's own
loader, and helpers that read expected values straight from checkpoint tensors.

Runs on CPU: the model is built by SGLang's own loader (gloo, world size 1). One stand-in: SGLang's
rotary embedding imports a CUDA-only vLLM op at construction on a non-CUDA, non-CPU-engine platform;
`vllm_rope_stub_for_cpu` provides that name (never called: no attention runs here). Test modules load
it with ``pytest_plugins = ["sglang_env"]`` after importing sglang (importorskip); it holds no asserts,
hence PYTEST_DONT_REWRITE (it is imported before pytest registers it as a plugin).
"""

import contextlib
import os
import sys
import types

import pytest
import torch
from safetensors import safe_open

from quads_megatron import checkpoint
from quads_megatron.integrations import sglang as plug
from quads_megatron.rollout.moe_block import ExpertWeights

H, INTER, E, LAYERS, TOPK = 64, 32, 4, 2, 2
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": H,
    "intermediate_size": 128,
    "moe_intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": E,
    "num_experts_per_tok": TOPK,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def write_checkpoints(root, **overrides):
    """A tiny BF16 Qwen3-MoE (QWEN3_MOE with overrides) written by transformers under root/bf16, and its
    `quads convert` output under root/nvfp4; returns root."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {k: v for k, v in {**QWEN3_MOE, **overrides}.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16)
    with torch.no_grad():  # experts of different magnitudes (distinct global scales)
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(torch.linspace(1, 4, p.shape[0]).view(-1, *[1] * (p.dim() - 1)).to(p.dtype))
    model.save_pretrained(root / "bf16", safe_serialization=True)
    checkpoint.convert_hf(str(root / "bf16"), str(root / "nvfp4"), checkpoint.ConvertOptions(progress=False))
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny BF16 Qwen3-MoE written by transformers, and its `quads convert` output."""
    return write_checkpoints(tmp_path_factory.mktemp("sgl"))


def read_dir(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as s:
                out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@contextlib.contextmanager
def cpu_runtime():
    """SGLang's process-wide state for building models on this CPU (gloo, world size 1): the rotary
    stand-in where vLLM is absent, and quads_nvfp4 registered."""
    added = []
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError:
        stub = types.ModuleType("vllm_rope_stub_for_cpu")
        stub.rotary_embedding = None
        for name, mod in (("vllm", types.ModuleType("vllm")), ("vllm._custom_ops", stub)):
            sys.modules[name] = mod
            added.append(name)
    plug.register()
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def sglang_runtime():
    with cpu_runtime():
        yield


_DIST = {}


def build_model(path, quantization="quads_nvfp4"):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=str(path), device="cpu", quantization=quantization)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
    if not _DIST:
        from helpers import free_port

        init_distributed_environment(
            backend="gloo",
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel(backend="gloo")
        _DIST["ok"] = True
    mc = ModelConfig.from_server_args(sa)
    return mc, get_model(model_config=mc, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))


def rank_model(rank: int, world: int, port: int, path, ep: int):
    """One rank's SGLang model of a TP=world run on CPU (gloo; ep: expert-parallel size), built in a process
    of its own (torch.multiprocessing.spawn)."""
    # a CUDA build of torch on a machine without a GPU: SGLang's NCCL communicator must stay off
    os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl-on-a-cpu-machine.so"
    stub = types.ModuleType("vllm_rope_stub_for_cpu")  # see cpu_runtime
    stub.rotary_embedding = None
    sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    sys.modules.setdefault("vllm._custom_ops", stub)
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    plug.register()
    sa = ServerArgs(model_path=str(path), device="cpu", quantization="quads_nvfp4", tp_size=world, ep_size=ep)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    init_distributed_environment(
        backend="gloo", world_size=world, rank=rank, local_rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}"
    )
    initialize_model_parallel(backend="gloo")
    return get_model(
        model_config=ModelConfig.from_server_args(sa), load_config=LoadConfig(), device_config=DeviceConfig("cpu")
    )


def model_config(path, quantization):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    return ModelConfig.from_server_args(ServerArgs(model_path=str(path), device="cpu", quantization=quantization))


def routing(t=7, seed=0, hidden=H):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, hidden, generator=g) * torch.exp(torch.randn(hidden, generator=g))).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)])
    return x, ids, torch.softmax(torch.randn(t, TOPK, generator=g), -1)


def expected_experts(tensors, layer) -> ExpertWeights:
    """Expert weights straight from ModelOpt tensors (not from the model's parameters)."""
    p = f"model.layers.{layer}.mlp.experts"

    def get(e, proj, kind):
        return tensors[f"{p}.{e}.{proj}.{kind}"]

    w13 = [torch.cat([get(e, "gate_proj", "weight"), get(e, "up_proj", "weight")]) for e in range(E)]
    s13 = [torch.cat([get(e, "gate_proj", "weight_scale"), get(e, "up_proj", "weight_scale")]) for e in range(E)]
    return ExpertWeights(
        torch.stack(w13),
        torch.stack(s13).view(torch.uint8),
        torch.stack([get(e, "gate_proj", "weight_scale_2").reshape(()) for e in range(E)]).float(),
        torch.stack([get(e, "down_proj", "weight") for e in range(E)]),
        torch.stack([get(e, "down_proj", "weight_scale") for e in range(E)]).view(torch.uint8),
        torch.stack([get(e, "down_proj", "weight_scale_2").reshape(()) for e in range(E)]).float(),
    )


def experts_of(model, layer):
    return model.model.layers[layer].mlp.experts


@pytest.fixture(scope="module")
def loaded(checkpoints, sglang_runtime):
    _, model = build_model(checkpoints / "nvfp4")
    return model


def param_bytes(model) -> dict[str, tuple[int, bytes]]:
    """Every parameter's storage address and bytes (NaN-safe, bit-exact comparison)."""
    return {
        n: (p.data_ptr(), p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        for n, p in model.named_parameters(remove_duplicate=False)
    }
