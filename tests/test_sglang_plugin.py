"""quads_nvfp4 against the real sglang package: registration, version and device guards, the API shims
for the supported SGLang versions, config parsing, checkpoint loading into a real Qwen3-MoE model, the
MoE forward, and the method's refusals. The live weight sync is in test_sglang_weight_sync.py; the
shared checkpoint/model environment in sglang_env.py.

What cannot run here: the CUDA-graph captured server and the Triton kernels at full size
(benchmarks/device_run.sh runs the plugin's MoE method on the H200).
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

from quads_megatron import nvfp4  # noqa: E402
from quads_megatron.config import RolloutConfig  # noqa: E402
from quads_megatron.integrations import sglang as plug  # noqa: E402
from quads_megatron.integrations.sglang import method as plug_method  # noqa: E402
from quads_megatron.integrations.sglang_versions import ALLOW_UNTESTED_ENV  # noqa: E402
from quads_megatron.rollout.moe_block import moe_w4a4  # noqa: E402
from sglang_env import (  # noqa: E402
    INTER,
    LAYERS,
    E,
    H,
    build_model,
    expected_experts,
    experts_of,
    model_config,
    read_dir,
    routing,
)

pytest_plugins = ["sglang_env"]


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
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    for ok in ("0.5.17", "0.5.20", "0.5.23", "0.5.23.post1", "0.5.23+cu130"):
        assert plug.check_version(ok) == ok
    for bad in ("0.5.9", "0.5.16", "0.5.24", "0.6.0", "1.0.0rc1"):
        with pytest.raises(plug.QuadsSglangError, match="QUADS_ALLOW_UNTESTED_SGLANG"):
            plug.check_version(bad)
    with pytest.raises(
        plug.QuadsSglangError, match=r">= 0.5.17, < 0.5.24 \(tested: 0.5.23 \(CPU tests\) and 0.5.17 \(GPU"
    ):
        plug.check_version("0.5.16")
    assert plug.check_version() == sglang.__version__  # the installed one is in range
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
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
            "rollout": {"activation_scale": "static", "rac": {"ratio": 0.5, "selection": "static"}},
            "rac_plans": {"model.layers.0.mlp.experts": {"w13": [0, 2], "w2": [1]}},
        },
    }
    c = plug.QuadsNvfp4Config.from_config(flat)
    assert c.rollout.activation_scale == "static" and c.rollout.rac.ratio == 0.5
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
    with pytest.raises(plug.QuadsSglangError, match="'model.layers.0.mlp.experts' must have exactly w13 and w2"):
        plug.QuadsNvfp4Config.from_config(bad_plan)
    bad_plan = dict(
        flat, quads={**flat["quads"], "rac_plans": {"model.layers.0.mlp.experts": {"w13": [9, 0], "w2": [1]}}}
    )
    with pytest.raises(plug.QuadsSglangError, match=r"bad RAC plan for 'model.layers.0.mlp.experts' w13 \(K=64\)"):
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
    assert cli_main(["convert", str(checkpoints / "bf16"), str(tmp_path / "x"), "--rac-plans", str(bad)]) == 3
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- device and SGLang versions


def sm86_gpu_stand_in():
    """An Ampere GPU's compute capability (no GPU exists on this CPU machine)."""
    return (8, 6)


def test_gpus_below_sm90_are_refused_with_the_reason(checkpoints, sglang_runtime, monkeypatch):
    assert plug.QuadsNvfp4Config.get_min_capability() == 90
    plug.check_device((9, 0))
    plug.check_device((10, 0))
    # SGLang builds the config (from_config) before its own capability check, whose message only
    # names the numbers: ours is the one a user of an sm_86 GPU sees, and it says why
    monkeypatch.setattr(plug_method, "_device_capability", sm86_gpu_stand_in)
    with pytest.raises(
        plug.QuadsSglangError, match=r"needs an sm_90 \(Hopper\) or newer GPU, this one is sm_86: .*FP8 e4m3.*wgmma"
    ):
        build_model(checkpoints / "nvfp4")


def moe_runner_config_0_5_17(**overrides):
    """MoeRunnerConfig as SGLang 0.5.17 defines it (its fields and defaults; no gemm1_beta, runner_backend,
    no_combine_keep_router_weight, silu_mul_keep_fp32): 0.5.17 itself cannot be installed next to 0.5.23."""
    fields = dict(
        num_experts=None, num_local_experts=None, hidden_size=None, intermediate_size_per_partition=None,
        layer_id=None, top_k=None, num_fused_shared_experts=None, params_dtype=None, routing_method_type=None,
        activation="silu", is_gated=True, apply_router_weight_on_input=False, inplace=True, no_combine=False,
        routed_scaling_factor=None, gemm1_alpha=None, gemm1_clamp_limit=None, swiglu_limit=None,
        gate_up_interleaved=True, layer=None, use_tp_all_gather_activation=False,
    )  # fmt: skip
    return types.SimpleNamespace(**{**fields, **overrides})


def test_compat_shims_take_both_api_shapes(sglang_runtime, monkeypatch):
    # QUANTIZATION_CHOICES: sglang.srt.arg_groups.choices (0.5.23), sglang.srt.server_args (0.5.17)
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.server_args import QUANTIZATION_CHOICES as server_args_choices

    from quads_megatron.integrations.sglang import compat

    assert compat.quantization_choices() is QUANTIZATION_CHOICES
    monkeypatch.setitem(sys.modules, "sglang.srt.arg_groups.choices", None)  # the 0.5.17 layout
    assert compat.quantization_choices() is server_args_choices
    plug.unregister()
    assert plug.METHOD not in server_args_choices
    plug.register()
    assert server_args_choices.count(plug.METHOD) == 1
    monkeypatch.delitem(sys.modules, "sglang.srt.arg_groups.choices")

    # MoeRunnerConfig: 0.5.23's fields, and 0.5.17's (fewer) ones
    assert compat.runner_config_unsupported(MoeRunnerConfig()) == []
    assert compat.runner_config_unsupported(moe_runner_config_0_5_17()) == []
    assert compat.runner_config_unsupported(MoeRunnerConfig(gemm1_beta=1.0)) == ["gemm1_beta"]
    got = compat.runner_config_unsupported(moe_runner_config_0_5_17(activation="gelu", no_combine=True))
    assert got == ["activation", "no_combine"]
    method = plug.QuadsNvfp4MoEMethod(plug.QuadsNvfp4Config([], RolloutConfig()), "model.layers.0.mlp.experts")
    with pytest.raises(plug.QuadsSglangError, match=r"experts: .*unsupported: \['gemm1_beta'\]"):
        method.create_moe_runner(None, MoeRunnerConfig(gemm1_beta=1.0))
    with pytest.raises(plug.QuadsSglangError, match=r"unsupported: \['no_combine'\]"):
        method.create_moe_runner(None, moe_runner_config_0_5_17(no_combine=True))
    method.create_moe_runner(None, moe_runner_config_0_5_17())


def flashinfer_trtllm_server_stand_in():
    """The runner backend a server started with --moe-runner-backend flashinfer_trtllm reports (such a
    server cannot start on this CPU machine)."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    return MoeRunnerBackend.FLASHINFER_TRTLLM


def deepep_server_stand_in():
    """The all-to-all backend of a server started with --moe-a2a-backend deepep (GPU only)."""
    from sglang.srt.layers.moe.utils import MoeA2ABackend

    return MoeA2ABackend.DEEPEP


def test_moe_backends_that_change_the_layout_or_dispatch_are_refused(checkpoints, sglang_runtime, monkeypatch):
    """0.5.17 takes the loader's and dispatcher's layout from the server's MoE backends (0.5.23 asks the
    method, which answers None), and both pad the intermediate size for flashinfer_trtllm before
    create_weights: the method accepts the default runner only."""
    import sglang.srt.layers.moe as moe

    monkeypatch.setattr(moe, "get_moe_runner_backend", flashinfer_trtllm_server_stand_in)
    with pytest.raises(
        plug.QuadsSglangError, match="experts: .*--moe-runner-backend flashinfer_trtllm is not supported"
    ):
        build_model(checkpoints / "nvfp4")
    monkeypatch.undo()
    monkeypatch.setattr(moe, "get_moe_a2a_backend", deepep_server_stand_in)
    with pytest.raises(plug.QuadsSglangError, match="--moe-a2a-backend deepep is not supported"):
        build_model(checkpoints / "nvfp4")


# ----------------------------------------------------------------------------- checkpoint and config siblings


def variant(checkpoints, tmp_path, name, quads=None, tensors=None, drop=None, drop_suffix=None, calibrated=False):
    """A copy of the converted checkpoint with a quads block in config.json, extra tensors, and without
    the tensors whose names start with drop (or end with drop_suffix); calibrated: its producer block says
    the input scales are calibrated (as a conversion with --input-amax writes)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / name
    shutil.copytree(checkpoints / "nvfp4", out)
    if quads is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"]["quads"] = quads
        (out / "config.json").write_text(json.dumps(cfg))
    if drop_suffix or calibrated:
        cfg = json.loads((out / "config.json").read_text())
        if drop_suffix:
            cfg["quantization_config"].pop("producer", None)
        else:
            cfg["quantization_config"]["producer"]["input_scale"] = "calibrated"
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors or drop or drop_suffix:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        (file,) = set(index["weight_map"].values())
        kept = {
            k: v
            for k, v in load_file(str(out / file)).items()
            if not (drop and k.startswith(drop)) and not (drop_suffix and k.endswith(drop_suffix))
        }
        save_file({**kept, **(tensors or {})}, str(out / file), metadata={"format": "pt"})
        index["weight_map"] = {k: file for k in {**kept, **(tensors or {})}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_experts_missing_from_the_checkpoint_are_refused(checkpoints, sglang_runtime, tmp_path):
    ckpt = variant(checkpoints, tmp_path, "missing", drop="model.layers.1.mlp.experts.2.")
    with pytest.raises(
        plug.QuadsSglangError, match=r"layers.1.mlp.experts.w13_weight_scale: .*local experts \[2\] \(NaN: not in"
    ):
        build_model(ckpt)


def input_scales(value_of):
    """input_scale of every expert's gate, up and down: value_of(layer, expert, proj) -> float."""
    return {
        f"model.layers.{layer}.mlp.experts.{e}.{proj}.input_scale": torch.tensor(value_of(layer, e, proj))
        for layer in range(LAYERS)
        for e in range(E)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }


def test_static_activation_scales_need_a_positive_input_scale_for_every_expert(checkpoints, sglang_runtime, tmp_path):
    static = {"rollout": {"activation_scale": "static"}}
    # without input_amax the converter writes the default input_scale and says so in its producer block
    with pytest.raises(plug.QuadsSglangError, match=r"static activation scales .* uncalibrated default"):
        build_model(variant(checkpoints, tmp_path, "none", static))
    # a checkpoint without input_scale tensors at all (another producer): every expert is missing one
    stripped = variant(checkpoints, tmp_path, "stripped", static, drop_suffix=".input_scale")
    with pytest.raises(plug.QuadsSglangError, match=r"layers.0.mlp.experts.w13_input_scale: .*static .*4 experts"):
        build_model(stripped)
    for name, bad in (("negative", -1e-3), ("nan", float("nan")), ("zero", 0.0)):
        scales = input_scales(lambda layer, e, proj, bad=bad: bad if (layer, e) == (1, 2) else 1e-3)
        with pytest.raises(
            plug.QuadsSglangError, match=r"layers.1.mlp.experts.w13_input_scale: .*1 experts \(first: 2"
        ):
            build_model(variant(checkpoints, tmp_path, name, static, scales, calibrated=True))
    scales = input_scales(lambda layer, e, proj: 1e-3 * (e + 1))
    _, model = build_model(variant(checkpoints, tmp_path, "good", static, scales, calibrated=True))
    assert float(experts_of(model, 1).w2_input_scale.max()) == pytest.approx(4e-3)
    dynamic = variant(checkpoints, tmp_path, "dynamic", {"rollout": {"activation_scale": "dynamic"}})
    build_model(dynamic)  # dynamic activation scales read no input_scale


def layer_plans(w13, w2):
    return {f"model.layers.{layer}.mlp.experts": {"w13": w13[layer], "w2": w2[layer]} for layer in range(LAYERS)}


def test_static_rac_plans_must_fit_each_layer_and_the_rollout_ratio(checkpoints, sglang_runtime, tmp_path, monkeypatch):
    monkeypatch.delenv(plug_method.CONFIG_ENV, raising=False)
    rollout = {"rac": {"ratio": 0.25, "selection": "static"}}  # H=64 -> 1 block of fc1, INTER=32 -> 1 of fc2
    ok = variant(checkpoints, tmp_path, "ok", {"rollout": rollout, "rac_plans": layer_plans([[0], [3]], [[1], [0]])})
    _, model = build_model(ok)
    assert experts_of(model, 1).quant_method.rac.fc1.plan.blocks.tolist() == [3]
    out_of_range = {"rollout": rollout, "rac_plans": layer_plans([[0], [4]], [[1], [0]])}
    with pytest.raises(
        plug.QuadsSglangError, match=r"bad RAC plan for 'model.layers.1.mlp.experts' w13 \(K=64\): .*\[0, 4\)"
    ) as err:
        build_model(variant(checkpoints, tmp_path, "range", out_of_range))
    assert "\n" not in str(err.value)
    # QUADS_CONFIG overrides the rollout: a ratio the checkpoint's plans were not made for is refused ...
    yml = tmp_path / "half.yaml"
    yml.write_text("rollout:\n  rac: {ratio: 0.5, selection: static}\n")
    monkeypatch.setenv(plug_method.CONFIG_ENV, str(yml))
    with pytest.raises(
        plug.QuadsSglangError,
        match=rf"'model.layers.0.mlp.experts' w13 compensates 16 of K=64 .*0.5 \(QUADS_CONFIG={yml}\) asks for 32",
    ):
        build_model(ok)
    # ... and so is static RAC on a checkpoint without plans, before any layer is built
    with pytest.raises(plug.QuadsSglangError, match=rf"QUADS_CONFIG={yml} asks for static RAC .* has no RAC plans"):
        build_model(checkpoints / "nvfp4")


@pytest.mark.parametrize(
    "plans, reason",
    [
        ([[0, 0], [1]], "unique non-negative"),
        ([[-1], [1]], "unique non-negative"),
        ([[True], [1]], "unique non-negative"),
        ([[0.0], [1]], "unique non-negative"),
        ([None, [1]], "unique non-negative"),
    ],
)
def test_malformed_rac_plans_are_refused_when_the_config_is_read(plans, reason, monkeypatch):
    monkeypatch.delenv(plug_method.CONFIG_ENV, raising=False)
    w13, w2 = plans
    cfg = {"quant_algo": "NVFP4", "quads": {"rac_plans": {"model.layers.0.mlp.experts": {"w13": w13, "w2": w2}}}}
    with pytest.raises(plug.QuadsSglangError, match=rf"RAC plan 'model.layers.0.mlp.experts' w13 must be .*{reason}"):
        plug.QuadsNvfp4Config.from_config(cfg)
    cfg["quads"]["rac_plans"] = {"model.layers.0.mlp.experts": [[0], [1]]}
    with pytest.raises(plug.QuadsSglangError, match="must have exactly w13 and w2 lists, got list"):
        plug.QuadsNvfp4Config.from_config(cfg)
