"""SGLang backend against the real sglang package: registration, config parsing, checkpoint loading
into a real Qwen3-MoE model, the MoE forward, and in-place weight sync.

Runs on CPU: the model is built by SGLang's own loader (gloo, world size 1). What cannot run here:
the CUDA-graph captured server and the Triton kernels at full size (benchmarks/device_run.sh runs
the plugin's MoE method on the H200). One stand-in: SGLang's rotary embedding imports a CUDA-only
vLLM op at construction on a non-CUDA, non-CPU-engine platform; `vllm_rope_stub_for_cpu` provides
that name (never called: no attention runs here).
"""

import json
import os
import shutil
import sys
import types

import pytest
import torch

if os.environ.get("QUADS_REQUIRE_SGLANG") == "1":
    import sglang  # noqa: F401  (CI: a missing sglang is a failure, not a skip)
sglang = pytest.importorskip("sglang")

from safetensors import safe_open  # noqa: E402

from quads_megatron import checkpoint, nvfp4  # noqa: E402
from quads_megatron.checkpoint import modelopt  # noqa: E402
from quads_megatron.config import RolloutConfig  # noqa: E402
from quads_megatron.integrations import sglang as plug  # noqa: E402
from quads_megatron.integrations.sglang import method as plug_method  # noqa: E402
from quads_megatron.rollout.moe_block import ExpertWeights, moe_w4a4  # noqa: E402

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


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny BF16 Qwen3-MoE written by transformers, and its `quads convert` output."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("sgl")
    cfg = {k: v for k, v in QWEN3_MOE.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16)
    with torch.no_grad():  # experts of different magnitudes (distinct global scales)
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(torch.linspace(1, 4, p.shape[0]).view(-1, *[1] * (p.dim() - 1)).to(p.dtype))
    model.save_pretrained(root / "bf16", safe_serialization=True)
    checkpoint.convert_hf(str(root / "bf16"), str(root / "nvfp4"), checkpoint.ConvertOptions(progress=False))
    return root


def read_dir(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as s:
                out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.fixture(scope="module")
def sglang_runtime():
    """SGLang's process-wide state for building models on this CPU (gloo, world size 1)."""
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
    yield
    for name in added:
        sys.modules.pop(name, None)


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


def model_config(path, quantization):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    return ModelConfig.from_server_args(ServerArgs(model_path=str(path), device="cpu", quantization=quantization))


def routing(t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, H, generator=g) * torch.exp(torch.randn(H, generator=g))).bfloat16()
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


# ----------------------------------------------------------------------------- registration and config


def test_entry_point_registers_once_and_first(sglang_runtime):
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    from sglang.srt.server_args import QUANTIZATION_CHOICES

    plug.unregister()
    assert plug.METHOD not in QUANTIZATION_METHODS and plug.METHOD not in QUANTIZATION_CHOICES
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)  # SGLang's own discovery of our entry point
    assert "quads_nvfp4" in found
    found["quads_nvfp4"][0]()
    found["quads_nvfp4"][0]()  # a second load (every SGLang process loads plugins) changes nothing
    assert QUANTIZATION_CHOICES.count(plug.METHOD) == 1
    assert next(iter(QUANTIZATION_METHODS)) == plug.METHOD
    assert QUANTIZATION_METHODS[plug.METHOD] is plug.QuadsNvfp4Config
    assert "modelopt_fp4" in QUANTIZATION_METHODS  # stock methods kept


def test_version_guard(monkeypatch):
    assert plug.check_version("0.5.23") == "0.5.23"
    for bad in ("0.5.9", "0.6.0", "1.0.0rc1"):
        with pytest.raises(plug.QuadsSglangError, match="QUADS_ALLOW_UNTESTED_SGLANG"):
            plug.check_version(bad)
    monkeypatch.setenv(plug_method.ALLOW_UNTESTED_ENV, "1")
    assert plug.check_version("0.6.0") == "0.6.0"


def test_config_parsing_and_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(plug_method.CONFIG_ENV, raising=False)
    nested = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*.self_attn*"]}}
    c = plug.QuadsNvfp4Config.from_config(nested)
    assert c.exclude_modules == ["lm_head", "*.self_attn*"]
    assert c.rollout.rac.selection == "dynamic" and c.rollout.rac.ratio == 0.5  # serves without calibration
    flat = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "ignore": ["lm_head"],
        "quads": {
            "rollout": {"activation_scale": "static", "rac": {"ratio": 0.25, "selection": "static"}},
            "rac_plans": {"model.layers.0.mlp.experts": {"w13": [0, 2], "w2": [1]}},
        },
    }
    c = plug.QuadsNvfp4Config.from_config(flat)
    assert c.rollout.activation_scale == "static" and c.rollout.rac.ratio == 0.25
    rac = c.layer_rac("model.layers.0.mlp.experts", H, INTER)
    assert rac.fc1.plan.blocks.tolist() == [0, 2] and rac.fc2.plan.blocks.tolist() == [1]
    with pytest.raises(plug.QuadsSglangError, match="no RAC plan for 'model.layers.1.mlp.experts'"):
        c.layer_rac("model.layers.1.mlp.experts", H, INTER)
    # QUADS_CONFIG (the same YAML the trainer reads) overrides the checkpoint's rollout block
    yml = tmp_path / "q.yaml"
    yml.write_text("rollout:\n  rac: {ratio: 0.125, selection: dynamic}\n")
    monkeypatch.setenv(plug_method.CONFIG_ENV, str(yml))
    c = plug.QuadsNvfp4Config.from_config(flat)
    assert c.rollout == RolloutConfig(rac=c.rollout.rac) and c.rollout.rac.ratio == 0.125
    assert c.layer_rac("x", H, INTER).fc1.dynamic_channels == 16
    yml.write_text("rollout:\n  rac: {ratio: 2}\n")
    with pytest.raises(plug.QuadsSglangError, match="rollout.rac.ratio"):
        plug.QuadsNvfp4Config.from_config(flat)
    monkeypatch.delenv(plug_method.CONFIG_ENV)
    with pytest.raises(plug.QuadsSglangError, match="quant_algo='FP8'"):
        plug.QuadsNvfp4Config.from_config({"quantization": {"quant_algo": "FP8"}})
    with pytest.raises(plug.QuadsSglangError, match="group_size must be 16"):
        plug.QuadsNvfp4Config.from_config({"quant_algo": "NVFP4", "group_size": 32})
    with pytest.raises(plug.QuadsSglangError, match="no 'quant_algo'"):
        plug.QuadsNvfp4Config.from_config({"weights": {}})
    bad_plan = dict(flat, quads={**flat["quads"], "rac_plans": {"model.layers.0.mlp.experts": {"w13": [9]}}})
    with pytest.raises(plug.QuadsSglangError, match="bad RAC plan"):
        plug.QuadsNvfp4Config.from_config(bad_plan).layer_rac("model.layers.0.mlp.experts", H, INTER)


def test_legacy_hf_quant_config_only_checkpoint_loads(checkpoints, sglang_runtime, tmp_path):
    """ModelOpt's older layout: no quantization_config in config.json, only hf_quant_config.json."""
    legacy = tmp_path / "legacy"
    shutil.copytree(checkpoints / "nvfp4", legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    del cfg["quantization_config"]
    (legacy / "config.json").write_text(json.dumps(cfg))
    mc, model = build_model(legacy)
    assert mc.quantization == "quads_nvfp4"
    assert isinstance(experts_of(model, 0).quant_method, plug.QuadsNvfp4MoEMethod)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16  # excluded: stays BF16


def test_model_config_selects_the_method(checkpoints, sglang_runtime, tmp_path):
    assert model_config(checkpoints / "nvfp4", "quads_nvfp4").quantization == "quads_nvfp4"
    assert model_config(checkpoints / "nvfp4", None).quantization == "modelopt_fp4"  # stock behaviour intact
    tagged = tmp_path / "tagged"
    shutil.copytree(checkpoints / "nvfp4", tagged)
    cfg = json.loads((tagged / "config.json").read_text())
    cfg["quantization_config"]["quads"] = {"rollout": {"rac": {"selection": "dynamic"}}}
    (tagged / "config.json").write_text(json.dumps(cfg))
    assert model_config(tagged, None).quantization == "quads_nvfp4"  # a QUADS checkpoint picks its method
    assert model_config(tagged, "modelopt_fp4").quantization == "modelopt_fp4"  # an explicit choice wins


# ----------------------------------------------------------------------------- loading and forward


@pytest.fixture(scope="module")
def loaded(checkpoints, sglang_runtime):
    _, model = build_model(checkpoints / "nvfp4")
    return model


def test_checkpoint_loads_bit_for_bit_into_sglang(checkpoints, loaded):
    conv, src = read_dir(checkpoints / "nvfp4"), read_dir(checkpoints / "bf16")
    for layer in range(LAYERS):
        moe = experts_of(loaded, layer)
        assert isinstance(moe.quant_method, plug.QuadsNvfp4MoEMethod)
        want = expected_experts(conv, layer)
        got = moe.quant_method.expert_weights(moe)
        for f in ("w13_codes", "w13_scales", "w13_sdec", "w2_codes", "w2_scales", "w2_sdec"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f
        # ... and what the server decodes is the trainer's qdq(W) of the BF16 source, bit for bit
        p = f"model.layers.{layer}.mlp.experts"
        for e in range(E):
            gate, up = src[f"{p}.{e}.gate_proj.weight"], src[f"{p}.{e}.up_proj.weight"]
            amax = nvfp4.shared_amax(gate, up)
            assert torch.equal(
                got.expert(e, "w13").dequantize(gate.dtype), nvfp4.qdq(torch.cat([gate, up]), global_amax=amax)
            )
            assert torch.equal(got.expert(e, "w2").dequantize(gate.dtype), nvfp4.qdq(src[f"{p}.{e}.down_proj.weight"]))
    attn = loaded.model.layers[0].self_attn.qkv_proj
    assert attn.weight.dtype == torch.bfloat16  # non-expert layers stay BF16


def test_moe_forward_through_sglang_equals_reference(checkpoints, loaded):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    conv = read_dir(checkpoints / "nvfp4")
    x, ids, w = routing()
    moe = experts_of(loaded, 1)
    got = moe(x, StandardTopKOutput(w, ids, torch.zeros(x.shape[0], E)))
    want = moe_w4a4(x, ids, w, expected_experts(conv, 1), moe.quant_method.rac, impl="reference")
    assert torch.equal(got, want)
    block = loaded.model.layers[1].mlp(x)  # router + top-k + experts, SGLang's own block
    assert block.shape == x.shape and torch.isfinite(block.float()).all()
    with pytest.raises(plug.QuadsSglangError, match="BF16/FP16 hidden states"):
        moe(x.float(), StandardTopKOutput(w, ids, torch.zeros(x.shape[0], E)))


def test_static_activation_scale_uses_the_checkpoint_input_scales(checkpoints, loaded, monkeypatch):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    moe = experts_of(loaded, 0)
    monkeypatch.setattr(moe.quant_method.quant_config, "rollout", RolloutConfig(activation_scale="static"))
    with torch.no_grad():
        moe.w13_input_scale.copy_(torch.linspace(1e-3, 4e-3, moe.w13_input_scale.numel()).view_as(moe.w13_input_scale))
        moe.w2_input_scale.fill_(2e-3)
    x, ids, w = routing(seed=5)
    amax = (nvfp4.amax_from_input_scale(torch.tensor(4e-3)), nvfp4.amax_from_input_scale(torch.tensor(2e-3)))
    want = moe_w4a4(x, ids, w, moe.quant_method.expert_weights(moe), moe.quant_method.rac, amax, impl="reference")
    assert torch.equal(moe(x, StandardTopKOutput(w, ids, torch.zeros(x.shape[0], E))), want)
    dynamic = moe_w4a4(x, ids, w, moe.quant_method.expert_weights(moe), moe.quant_method.rac, impl="reference")
    assert not torch.equal(want, dynamic)


# ----------------------------------------------------------------------------- live weight sync


def snapshot(model):
    return {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters() if ".experts." in n}


def perturbed_bf16(checkpoints, seed):
    g = torch.Generator().manual_seed(seed)
    src = read_dir(checkpoints / "bf16")
    return {n: (t.float() * (1 + 0.3 * torch.rand(t.shape, generator=g))).bfloat16() for n, t in src.items()}


def test_trainer_packed_weights_sync_in_place(checkpoints, loaded):
    """The trainer's export (megatron_expert_tensors) -> load_weights: written in place, used at once."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    new = perturbed_bf16(checkpoints, 1)
    megatron = []
    for layer in range(LAYERS):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            fc1 = torch.cat([new[f"{p}.gate_proj.weight"], new[f"{p}.up_proj.weight"]])
            megatron.append((f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight", fc1))
            megatron.append(
                (
                    f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc2.weight",
                    new[f"{p}.down_proj.weight"],
                )
            )
    packed = dict(checkpoint.megatron_expert_tensors(megatron, num_local_experts=E))
    before = snapshot(loaded)
    for bucket in checkpoint.bucketed(packed.items(), bucket_bytes=1200):  # smaller than one gate+up pair
        plug.load_weights(loaded, bucket)
    after = snapshot(loaded)
    assert all(after[n][0] == before[n][0] for n in before)  # same storage: CUDA graphs stay valid
    assert any(not torch.equal(after[n][1], before[n][1]) for n in before)
    x, ids, w = routing(seed=3)
    for layer in range(LAYERS):
        moe = experts_of(loaded, layer)
        want = moe_w4a4(x, ids, w, expected_experts(packed, layer), moe.quant_method.rac, impl="reference")
        assert torch.equal(moe(x, StandardTopKOutput(w, ids, torch.zeros(x.shape[0], E))), want)


def test_bf16_sync_quantizes_with_the_contract(checkpoints, loaded):
    new = perturbed_bf16(checkpoints, 2)
    p = "model.layers.0.mlp.experts.2"
    names = [f"{p}.gate_proj.weight", f"{p}.down_proj.weight", f"{p}.up_proj.weight"]
    plug.load_weights(loaded, [(n, new[n]) for n in names])
    got = experts_of(loaded, 0).quant_method.expert_weights(experts_of(loaded, 0))
    gate, up = new[names[0]], new[names[2]]
    assert got.expert(2, "w13").same_bits(
        nvfp4.quantize(torch.cat([gate, up]), global_amax=nvfp4.shared_amax(gate, up))
    )
    assert got.expert(2, "w2").same_bits(nvfp4.quantize(new[names[1]]))


def test_bad_updates_are_refused_and_nothing_is_written(checkpoints, loaded):
    new = perturbed_bf16(checkpoints, 4)
    p = "model.layers.1.mlp.experts.0"
    good = dict(
        modelopt.modelopt_tensors(
            f"{p}.down_proj", modelopt.quantize_linear(new[f"{p}.down_proj.weight"], "d"), None
        )
    )
    gate_q = modelopt.quantize_linear(new[f"{p}.gate_proj.weight"], "g")
    gate = modelopt.modelopt_tensors(f"{p}.gate_proj", gate_q, None)
    up = modelopt.modelopt_tensors(f"{p}.up_proj", modelopt.quantize_linear(new[f"{p}.up_proj.weight"], "u"), None)
    nan = new["model.layers.1.self_attn.o_proj.weight"].clone()
    nan[0, 0] = float("nan")
    cases = {
        "NaN/Inf": [*good.items(), ("model.layers.1.self_attn.o_proj.weight", nan)],
        "differs from": [*good.items(), *gate.items(), *up.items()],  # gate/up quantized with separate amaxes
        "send gate and up global scales together": [*good.items(), *gate.items()],
        "same update": [*good.items(), (f"{p}.gate_proj.weight", new[f"{p}.gate_proj.weight"])],
        "negative block scales": [
            *good.items(),
            (f"{p}.down_proj.weight_scale", -good[f"{p}.down_proj.weight_scale"].float()),
        ],
    }
    before = {n: t.detach().clone() for n, t in loaded.state_dict().items()}
    for msg, update in cases.items():
        with pytest.raises(plug.QuadsSglangError, match=msg):
            plug.load_weights(loaded, update)
        assert all(torch.equal(before[n], t) for n, t in loaded.state_dict().items()), msg


def test_quantized_dense_layers_and_static_rac_without_plans_are_refused(checkpoints, sglang_runtime, tmp_path):
    dense = tmp_path / "dense"
    shutil.copytree(checkpoints / "nvfp4", dense)
    hq = json.loads((dense / "hf_quant_config.json").read_text())
    hq["quantization"]["exclude_modules"] = ["lm_head"]
    (dense / "hf_quant_config.json").write_text(json.dumps(hq))
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head"]
    (dense / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(plug.QuadsSglangError, match="keeps non-expert layers in BF16"):
        build_model(dense)
    static = tmp_path / "static"
    shutil.copytree(checkpoints / "nvfp4", static)
    cfg = json.loads((static / "config.json").read_text())
    cfg["quantization_config"]["quads"] = {"rollout": {"rac": {"selection": "static"}}}
    (static / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(plug.QuadsSglangError, match="no RAC plan"):
        build_model(static)


def test_calibrated_rac_plans_travel_from_converter_to_the_server(checkpoints, sglang_runtime, tmp_path):
    """RACCalibrator -> save_rac_plans -> quads convert --rac-plans --quads-config -> quads_nvfp4 layers."""
    from quads_megatron.cli import main as cli_main
    from quads_megatron.config import RACConfig
    from quads_megatron.rollout import calibration

    cal = calibration.RACCalibrator()
    g = torch.Generator().manual_seed(5)
    for layer in range(LAYERS):
        for gemm, k in (("w13", H), ("w2", INTER)):
            x = torch.randn(64, k, generator=g) * torch.exp(torch.randn(k, generator=g))
            cal.observe(f"model.layers.{layer}.mlp.experts.{gemm}", x)
    plans = cal.plans(RACConfig(ratio=0.25).num_channels)
    calibration.save_rac_plans(str(tmp_path / "plans.safetensors"), plans)
    (tmp_path / "q.yaml").write_text("rollout:\n  rac: {ratio: 0.25, selection: static}\n")
    out = tmp_path / "with_plans"
    rc = cli_main(
        ["convert", str(checkpoints / "bf16"), str(out), "--quiet", "--rac-plans", str(tmp_path / "plans.safetensors")]
        + ["--quads-config", str(tmp_path / "q.yaml")]
    )
    assert rc == 0
    assert model_config(out, None).quantization == "quads_nvfp4"  # the checkpoint names its method
    _, model = build_model(out)
    for layer in range(LAYERS):
        rac = experts_of(model, layer).quant_method.rac
        p = f"model.layers.{layer}.mlp.experts"
        assert torch.equal(rac.fc1.plan.blocks, plans[f"{p}.w13"].blocks)
        assert torch.equal(rac.fc2.plan.blocks, plans[f"{p}.w2"].blocks)
        assert rac.fc1.plan.num_channels == H // 4 and rac.fc1.mask is not None  # device mask made at load
    bad = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    save_file({"model.layers.0.mlp.experts.w13": torch.tensor([0])}, str(bad))
    assert cli_main(["convert", str(checkpoints / "bf16"), str(tmp_path / "x"), "--rac-plans", str(bad)]) == 2
    assert not (tmp_path / "x").exists()
