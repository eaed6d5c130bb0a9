"""quads_nvfp4 under an NVFP4 variant (4over6), against the real sglang package on CPU: the method reads
the variant `quads convert` recorded, the weights SGLang loads are the trainer's fake-quantized weights
under it, the MoE forward quantizes activations with the variant's activation recipe (static input_scale
included), live BF16 sync quantizes with its weight recipe, and what the method cannot serve is refused.
"""

import os

import pytest
import torch

if os.environ.get("QUADS_REQUIRE_SGLANG") == "1":
    import sglang  # noqa: F401  (CI: a missing sglang is a failure, not a skip)
sglang = pytest.importorskip("sglang")

from quads_megatron import checkpoint, fake_quant, nvfp4  # noqa: E402
from quads_megatron.config import NVFP4Config, RolloutConfig, load_config  # noqa: E402
from quads_megatron.integrations import sglang as plug  # noqa: E402
from quads_megatron.integrations.sglang import method as plug_method  # noqa: E402
from quads_megatron.rollout.moe_block import moe_w4a4  # noqa: E402
from sglang_env import LAYERS, E, build_model, experts_of, read_dir, routing  # noqa: E402

pytest_plugins = ["sglang_env"]

#: weights and activations in 4over6 with the 256 global bound, MSE candidate error
VARIANT = {"nvfp4_4over6": "all", "nvfp4_4over6_err_mode": "MSE"}
ACT_AMAX = {"gate_proj": 3.0, "up_proj": 3.0, "down_proj": 1.5}


@pytest.fixture(scope="module")
def variant_checkpoint(checkpoints):
    cfg = load_config({"nvfp4": VARIANT}).nvfp4
    amax = {
        f"model.layers.{i}.mlp.experts.{e}.{p}": a for i in range(LAYERS) for e in range(E) for p, a in ACT_AMAX.items()
    }
    opts = checkpoint.ConvertOptions(progress=False, nvfp4=cfg, input_amax=amax)
    checkpoint.convert_hf(str(checkpoints / "bf16"), str(checkpoints / "fos"), opts)
    return checkpoints / "fos", cfg


@pytest.fixture(scope="module")
def fos_model(variant_checkpoint, sglang_runtime):
    os.environ.pop(plug_method.CONFIG_ENV, None)
    _, model = build_model(variant_checkpoint[0])
    return model


def test_the_method_reads_the_variant_from_the_checkpoint(variant_checkpoint, fos_model):
    cfg = variant_checkpoint[1]
    qc = experts_of(fos_model, 0).quant_method.quant_config
    assert qc.nvfp4_config == cfg and qc.nvfp4_config.activations == nvfp4.NVFP4Recipe(True, 256, "MSE")


def test_loaded_weights_are_the_trainers_qdq_under_the_variant(checkpoints, variant_checkpoint, fos_model):
    cfg = variant_checkpoint[1]
    src = read_dir(checkpoints / "bf16")
    spec = fake_quant.FakeQuantSpec(recipe=cfg.weights)
    differs = 0
    for layer in range(LAYERS):
        moe = experts_of(fos_model, layer)
        got = moe.quant_method.expert_weights(moe)
        p = f"model.layers.{layer}.mlp.experts"
        for e in range(E):
            fc1 = torch.cat([src[f"{p}.{e}.gate_proj.weight"], src[f"{p}.{e}.up_proj.weight"]])
            w13 = got.expert(e, "w13").dequantize(fc1.dtype)
            assert torch.equal(w13, fake_quant.qdq_weight(fc1, spec))
            w2 = src[f"{p}.{e}.down_proj.weight"]
            assert torch.equal(got.expert(e, "w2").dequantize(w2.dtype), fake_quant.qdq_weight(w2, spec))
            differs += not torch.equal(w13, fake_quant.qdq_weight(fc1, fake_quant.FakeQuantSpec()))
    assert differs == LAYERS * E  # 4over6 (256) changed every expert's weights


def test_forward_quantizes_activations_with_the_variant(fos_model, variant_checkpoint):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    recipe = variant_checkpoint[1].activations
    x, ids, w = routing(seed=11)
    moe = experts_of(fos_model, 1)
    got = moe(x, StandardTopKOutput(w, ids, torch.zeros(x.shape[0], E)))
    weights, rac = moe.quant_method.expert_weights(moe), moe.quant_method.rac
    assert torch.equal(got, moe_w4a4(x, ids, w, weights, rac, impl="reference", recipe=recipe))
    assert not torch.equal(got, moe_w4a4(x, ids, w, weights, rac, impl="reference"))


def test_static_activation_scales_decode_input_scale_with_the_recipe(fos_model, monkeypatch):
    """input_scale = amax / (6 * 256) in the checkpoint; the static amax the GEMMs use is the calibrated one."""
    moe = experts_of(fos_model, 0)
    monkeypatch.setattr(moe.quant_method.quant_config, "rollout", RolloutConfig(activation_scale="static"))
    a13, a2 = moe.quant_method.static_amax(moe)
    assert a13.item() == pytest.approx(ACT_AMAX["gate_proj"], rel=1e-6)
    assert a2.item() == pytest.approx(ACT_AMAX["down_proj"], rel=1e-6)
    assert moe.w2_input_scale[0].item() == pytest.approx(ACT_AMAX["down_proj"] / 1536, rel=1e-6)


def test_bf16_live_sync_quantizes_with_the_checkpoint_weight_recipe(checkpoints, variant_checkpoint, fos_model):
    recipe = variant_checkpoint[1].weights
    src = read_dir(checkpoints / "bf16")
    p = "model.layers.1.mlp.experts.3"
    new = {
        n: (src[n].float() * 1.25).bfloat16()
        for n in (f"{p}.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj"))
    }
    plug.load_weights(fos_model, list(new.items()))
    got = experts_of(fos_model, 1).quant_method.expert_weights(experts_of(fos_model, 1))
    gate, up = new[f"{p}.gate_proj.weight"], new[f"{p}.up_proj.weight"]
    want = nvfp4.quantize(torch.cat([gate, up]), global_amax=nvfp4.shared_amax(gate, up), recipe=recipe)
    assert got.expert(3, "w13").same_bits(want)
    assert got.expert(3, "w2").same_bits(nvfp4.quantize(new[f"{p}.down_proj.weight"], recipe=recipe))
    assert not got.expert(3, "w2").same_bits(nvfp4.quantize(new[f"{p}.down_proj.weight"]))


def _flat(nvfp4_record):
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "quads": {"nvfp4": nvfp4_record}}


@pytest.mark.parametrize(
    "record,reason",
    [
        ({"row_scaled_activation": False}, "nvfp4.row_scaled_activation: false"),
        ({"nvfp4_4over6": "gradients"}, "nvfp4.nvfp4_4over6: must be one of"),
        ({"nvfp4_use_rht": True}, "nvfp4.nvfp4_use_rht: unknown key"),
        (["all"], "nvfp4: expected a mapping"),
    ],
)
def test_variants_the_method_cannot_serve_are_refused(record, reason, monkeypatch):
    monkeypatch.delenv(plug_method.CONFIG_ENV, raising=False)
    with pytest.raises(plug.QuadsSglangError, match=r"quads\.nvfp4\) is not served: " + reason):
        plug.QuadsNvfp4Config.from_config(_flat(record))


def test_quads_config_must_name_the_checkpoints_variant(tmp_path, monkeypatch):
    monkeypatch.delenv(plug_method.CONFIG_ENV, raising=False)
    assert plug.QuadsNvfp4Config.from_config(_flat(VARIANT)).nvfp4_config == load_config({"nvfp4": VARIANT}).nvfp4
    plain = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    assert plug.QuadsNvfp4Config.from_config(plain).nvfp4_config == NVFP4Config()  # stock ModelOpt: plain
    yml = tmp_path / "q.yaml"
    yml.write_text("nvfp4:\n  nvfp4_4over6: weights\n")
    monkeypatch.setenv(plug_method.CONFIG_ENV, str(yml))
    with pytest.raises(plug.QuadsSglangError, match="trainer and rollout would make different numbers"):
        plug.QuadsNvfp4Config.from_config(_flat(VARIANT))
    with pytest.raises(plug.QuadsSglangError, match="trainer and rollout would make different numbers"):
        plug.QuadsNvfp4Config.from_config(plain)
    yml.write_text("nvfp4:\n  nvfp4_4over6: all\n  nvfp4_4over6_err_mode: mse\n")
    assert plug.QuadsNvfp4Config.from_config(_flat(VARIANT)).nvfp4_config.weights.err_mode == "MSE"
