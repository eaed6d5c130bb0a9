"""The NVFP4 variants (config nvfp4 section) end to end, without SGLang: the trainer's fake-quantized weights
on a real megatron-core MoE layer equal what live sync and `quads convert` write under the same variant, the
converter records the variant, and the rollout's activation quantization (torch reference and the Triton
kernels under TRITON_INTERPRET=1) follows it. Bit-exactness against TE itself: test_te_golden.py.
"""

from __future__ import annotations

import json

import pytest
import torch

import quads_megatron
from quads_megatron import checkpoint, fake_quant, nvfp4
from quads_megatron.checkpoint import ConvertError, ConvertOptions
from quads_megatron.cli import EXIT_INPUT, main
from quads_megatron.config import NVFP4Config, QuadsConfig, QuadsConfigError, load_config
from quads_megatron.demo.cpu_megatron import build_moe_layer, moe_config
from quads_megatron.integrations.megatron import calibration as megatron_calibration
from quads_megatron.integrations.megatron import qat as megatron_core
from quads_megatron.kernels import act_quant
from quads_megatron.kernels.tile_configs import ActQuantConfig
from quads_megatron.rollout import calibration, moe_block, rac_plan, reference
from test_convert import E, L, dq, hf_moe_state, read_all, write_hf

#: nvfp4 sections that together cover every per-tensor recipe: weights / activations, 4over6 or not,
#: e4m3_max 256 / 448, MAE / MSE
VARIANTS = {
    "plain": {},
    "all_256_mae": {"nvfp4_4over6": "all"},
    "weights_448_mse": {"nvfp4_4over6": "weights", "nvfp4_4over6_e4m3_use_256": "none", "nvfp4_4over6_err_mode": "MSE"},
    "activations_256_mse": {"nvfp4_4over6": "activations", "nvfp4_4over6_err_mode": "MSE"},
}
GATE_UP = ("gate_proj", "up_proj")
RECIPES = [
    nvfp4.NVFP4Recipe(True, 256, "MAE"),
    nvfp4.NVFP4Recipe(True, 448, "MSE"),
    nvfp4.NVFP4Recipe(True, 448, "MAE"),
]


def nvfp4_config(variant: str) -> NVFP4Config:
    return load_config({"nvfp4": VARIANTS[variant]}).nvfp4


def outliers(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.exp(torch.randn(k, generator=g) * 1.2)).bfloat16()


# ----------------------------------------------------------------------------- trainer == rollout weights


def dq32(tensors, mod):
    """fp32 dequantization of one ModelOpt linear (the trainer's weights here are fp32)."""
    t = nvfp4.from_modelopt(tensors[f"{mod}.weight"], tensors[f"{mod}.weight_scale"], tensors[f"{mod}.weight_scale_2"])
    return nvfp4.dequantize(t)


def _run(layer, x):
    out, _ = layer(x)
    return out.detach()


@pytest.mark.usefixtures("megatron_world", "clean_quads_patches")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_trainer_forward_weights_are_the_live_sync_weights(variant):
    """A real MoE layer under apply(config): its forward equals an unpatched copy whose expert weights are
    the dequantized tensors live sync sends under the same nvfp4 variant (gate|up from one fc1 amax)."""
    cfg = QuadsConfig.from_dict({"nvfp4": VARIANTS[variant]})
    quads_megatron.apply(cfg)
    layer = build_moe_layer(moe_config(), seed=0)
    named = [(f"decoder.layers.0.mlp.{n}", p.detach()) for n, p in layer.named_parameters() if ".local_experts." in n]
    sent = dict(checkpoint.megatron_expert_tensors(named, 0, 4, nvfp4_config=cfg.nvfp4))
    ref = build_moe_layer(moe_config(), seed=0)
    megatron_core.leave_unquantized(ref)
    plain = build_moe_layer(moe_config(), seed=0)
    megatron_core.leave_unquantized(plain)
    with torch.no_grad():
        for e, (expert, p_expert) in enumerate(
            zip(ref.experts.local_experts, plain.experts.local_experts, strict=True)
        ):
            base = f"model.layers.0.mlp.experts.{e}"
            w1 = torch.cat([dq32(sent, f"{base}.gate_proj"), dq32(sent, f"{base}.up_proj")])
            expert.linear_fc1.weight.copy_(w1)
            expert.linear_fc2.weight.copy_(dq32(sent, f"{base}.down_proj"))
            p_expert.linear_fc1.weight.copy_(nvfp4.qdq(p_expert.linear_fc1.weight))
            p_expert.linear_fc2.weight.copy_(nvfp4.qdq(p_expert.linear_fc2.weight))
    x = torch.randn(6, 2, 32)
    out = _run(layer, x)
    assert torch.equal(out, _run(ref, x))
    # the variant changes the numbers exactly when it changes the weights' recipe
    assert torch.equal(out, _run(plain, x)) == (cfg.nvfp4.weights == nvfp4.NVFP4Recipe())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_converter_writes_the_trainer_qdq_and_records_the_variant(variant, tmp_path):
    cfg = nvfp4_config(variant)
    sd = hf_moe_state()
    src = write_hf(tmp_path / "hf", sd)
    amax = {f"model.layers.{i}.mlp.experts.{e}.{p}": 3.0 for i in range(L) for e in range(E) for p in GATE_UP}
    amax.update({f"model.layers.{i}.mlp.experts.{e}.down_proj": 12.0 for i in range(L) for e in range(E)})
    opts = ConvertOptions(progress=False, nvfp4=cfg, input_amax=amax, verify=True)
    checkpoint.convert_hf(str(src), str(tmp_path / "out"), opts)
    out = read_all(tmp_path / "out")
    spec = fake_quant.FakeQuantSpec(recipe=cfg.weights)
    for layer in range(L):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            fc1 = torch.cat([sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"]])
            assert torch.equal(
                torch.cat([dq(out, f"{p}.gate_proj"), dq(out, f"{p}.up_proj")]), fake_quant.qdq_weight(fc1, spec)
            )
            assert torch.equal(dq(out, f"{p}.down_proj"), fake_quant.qdq_weight(sd[f"{p}.down_proj.weight"], spec))
            # ModelOpt's input_scale is S_dec of the activations' recipe: amax / (6 * e4m3_max)
            want = torch.div(1.0, torch.tensor(6.0 * cfg.activations.e4m3_max) / 12.0)
            assert torch.equal(out[f"{p}.down_proj.input_scale"], want)
    hq = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert hq["producer"]["nvfp4"]["weights"] == cfg.weights.to_dict() == qc["producer"]["nvfp4"]["weights"]
    assert hq["producer"]["nvfp4"]["activations"] == cfg.activations.to_dict()
    assert qc["quant_algo"] == "NVFP4" and hq["quantization"]["quant_algo"] == "NVFP4"  # ModelOpt fields as before
    if cfg.is_default:
        assert "quads" not in qc  # a plain conversion is a plain ModelOpt checkpoint
    else:
        assert qc["quads"]["nvfp4"] == cfg.to_dict() == hq["quads"]["nvfp4"]
        # verifying against plain NVFP4 fails: the codes (or the input scales) are the variant's
        with pytest.raises(ConvertError, match="differs from the contract quantization|input_scale is not"):
            checkpoint.verify_conversion(str(src), str(tmp_path / "out"), ConvertOptions(input_amax=amax))
    p = "model.layers.0.mlp.experts.0"
    fc1 = torch.cat([sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"]])
    named = [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", fc1)]
    live = dict(checkpoint.megatron_expert_tensors(named, 0, E, input_amax=amax, nvfp4_config=cfg))
    assert len(live) == 8
    for name, t in live.items():  # live sync sends the converter's bytes
        assert torch.equal(t.reshape(-1).view(torch.uint8), out[name].reshape(-1).view(torch.uint8)), name


def test_quads_convert_takes_the_variant_from_the_yaml(tmp_path, capsys):
    src = write_hf(tmp_path / "hf", hf_moe_state())
    (tmp_path / "fos.yaml").write_text("nvfp4:\n  nvfp4_4over6: weights\n  nvfp4_4over6_err_mode: mse\n")
    assert (
        main(["convert", str(src), str(tmp_path / "out"), "--quiet", "--quads-config", str(tmp_path / "fos.yaml")]) == 0
    )
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quads"]["nvfp4"]["nvfp4_4over6"] == "weights" and qc["quads"]["nvfp4"]["nvfp4_4over6_err_mode"] == "MSE"
    cfg = load_config(tmp_path / "fos.yaml").nvfp4
    assert checkpoint.verify_conversion(str(src), str(tmp_path / "out"), ConvertOptions(nvfp4=cfg, progress=False))
    capsys.readouterr()
    (tmp_path / "row.yaml").write_text("nvfp4:\n  row_scaled_activation: false\n")
    rc = main(["convert", str(src), str(tmp_path / "out2"), "--quiet", "--quads-config", str(tmp_path / "row.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_INPUT and len(err) == 1 and "nvfp4.row_scaled_activation: false" in err[0]
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out2.partial").exists()


def test_convert_options_take_the_variant_once():
    cfg = nvfp4_config("all_256_mae")
    with pytest.raises(ConvertError, match="pass the variant once"):
        ConvertOptions(nvfp4=cfg, quads={"nvfp4": NVFP4Config().to_dict()})
    assert ConvertOptions(nvfp4=cfg).quads_block() == {"nvfp4": cfg.to_dict()}
    assert ConvertOptions(nvfp4=cfg).fingerprint() != ConvertOptions().fingerprint()
    assert ConvertOptions(quads={"rollout": {}}).quads_block() == {"rollout": {}}


def test_row_scaled_weights_have_no_modelopt_form():
    """TE's row_scaled_nvfp4 on a weight (scale_mode='row') is refused where a ModelOpt tensor is made, and
    in the trainer config, with a one-line error naming the option."""
    with pytest.raises(nvfp4.NVFP4InputError, match=r"row-scaled NVFP4 weights \(scale_mode='row'"):
        nvfp4.quantize(torch.randn(8, 32), "row").to_modelopt()
    with pytest.raises(QuadsConfigError, match=r"^trainer\.scale_mode: only 'tensor'"):
        QuadsConfig.from_dict({"trainer": {"scale_mode": "row"}})


# ----------------------------------------------------------------------------- rollout activations


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("rac", ["none", "static", "dynamic"])
@pytest.mark.parametrize("static", [False, True])
def test_triton_activation_quant_follows_the_recipe(recipe, rac, static):
    """act_quant (codes and the GEMM operand) == the torch reference under each recipe, RAC residual
    included, one pass and two passes over K; and the recipe changes the codes."""
    k = 128
    x = outliers(9, k)
    plan = rac_plan.RACPlan(torch.tensor([0, 5]), k) if rac == "static" else None
    channels = 32 if rac == "dynamic" else 0
    amax = torch.tensor(7.0) if static else None
    want = reference.quantize_activation(x, plan, amax, channels, recipe)
    for block_k in (None, 32) if rac != "dynamic" else (None,):
        tiles = ActQuantConfig(block_m=4, block_k=block_k)
        got = act_quant.quantize_activation(x, plan, amax, tiles, dynamic_channels=channels, recipe=recipe)
        assert got.x.same_bits(want.x)
        assert (got.residual is None) == (want.residual is None)
        if want.residual is not None:
            assert got.residual.same_bits(want.residual)
        op = act_quant.activation_operand(x, plan, amax, tiles, dynamic_channels=channels, recipe=recipe)
        v = (reference._exact_values(want.x) / 128).half()
        if want.residual is not None:
            v = (v.float() + (reference._exact_values(want.residual) / 128).half().float()).half()
        assert torch.equal(op.values[:, 0], v[:, 0::2]) and torch.equal(op.values[:, 1], v[:, 1::2])
    assert not want.x.same_bits(reference.quantize_activation(x, plan, amax, channels).x)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_moe_block_quantizes_activations_with_the_recipe(impl):
    h, i, e, t = 64, 32, 3, 5
    g = torch.Generator().manual_seed(1)
    w13 = [nvfp4.quantize(torch.randn(2 * i, h, generator=g) * 0.1) for _ in range(e)]
    w2 = [nvfp4.quantize(torch.randn(h, i, generator=g) * 0.1) for _ in range(e)]
    weights = moe_block.ExpertWeights(
        torch.stack([w.codes for w in w13]),
        torch.stack([w.block_scales for w in w13]).view(torch.uint8),
        torch.stack([w.global_decode for w in w13]),
        torch.stack([w.codes for w in w2]),
        torch.stack([w.block_scales for w in w2]).view(torch.uint8),
        torch.stack([w.global_decode for w in w2]),
    )
    x = outliers(t, h, seed=2)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
    tw = torch.softmax(torch.randn(t, 2, generator=g), -1)
    rac = moe_block.LayerRAC(moe_block.GemmRAC(dynamic_channels=16), moe_block.GemmRAC(dynamic_channels=16))
    recipe = nvfp4.NVFP4Recipe(True, 256, "MAE")
    got = moe_block.moe_w4a4(x, ids, tw, weights, rac, impl=impl, recipe=recipe)
    assert torch.equal(got, moe_block.moe_w4a4(x, ids, tw, weights, rac, impl="reference", recipe=recipe))
    assert not torch.equal(got, moe_block.moe_w4a4(x, ids, tw, weights, rac, impl="reference"))


def test_input_scale_round_trip_under_the_activation_recipe():
    r = nvfp4.NVFP4Recipe(True, 256, "MAE")
    a = torch.tensor([1e-3, 0.37, 5.0, 1234.5])
    s = nvfp4.input_scale_from_amax(a, r)
    assert torch.allclose(s, a / 1536, rtol=2**-22)
    s_enc = nvfp4.global_encode_scale(nvfp4.amax_from_input_scale(s, r), r)
    assert torch.all((s_enc - 1 / s).abs() <= torch.finfo(torch.float32).eps * (1 / s))


# ----------------------------------------------------------------------------- calibration


def test_calibrator_scores_residuals_under_the_recipe():
    x = outliers(32, 64, seed=4)
    recipe = nvfp4.NVFP4Recipe(True, 256, "MSE")
    cal = calibration.RACCalibrator("residual", recipe)
    cal.observe("l.w13", x)
    assert torch.equal(cal.stats["l.w13"], reference.residual_block_scores(x, recipe=recipe).sum(0))
    plain = calibration.RACCalibrator("residual")
    plain.observe("l.w13", x)
    assert not torch.equal(cal.stats["l.w13"], plain.stats["l.w13"])
    assert cal.merged().recipe == recipe


def test_megatron_calibration_takes_the_configs_activation_recipe():
    cfg = {"nvfp4": {"nvfp4_4over6": "activations"}}
    cal = megatron_calibration._calibrator(None, cfg)
    assert cal.recipe == load_config(cfg).nvfp4.activations == nvfp4.NVFP4Recipe(True, 256, "MAE")
    with pytest.raises(ValueError, match="differs from the config's nvfp4 activation recipe"):
        megatron_calibration._calibrator(calibration.RACCalibrator(), cfg)


def test_gated_wgmma_operand_follows_the_recipe():
    """fc2's fused path (SiLU(gate) * up, foreign rows zeroed, Hopper operand order) under 4over6 is the
    4over6 quantization of the gated activation itself, permuted."""
    wg = pytest.importorskip("quads_megatron.kernels.gemm_wgmma_launch", reason="needs a Triton with Gluon")
    recipe = nvfp4.NVFP4Recipe(True, 256, "MSE")
    m, k = 6, 128
    y1 = outliers(m, 2 * k, seed=7)
    valid = torch.tensor([True, False, True, True, False, True])
    h = torch.where(valid[:, None], moe_block.gated_activation(y1), 0.0)
    want = act_quant.activation_operand(h, dynamic_channels=32, recipe=recipe)
    got = act_quant.activation_operand(
        y1, dynamic_channels=32, gated=True, row_valid=valid, order="wgmma", recipe=recipe
    )
    natural = want.values.permute(0, 2, 1).reshape(m, k)
    assert torch.equal(got.values, natural[:, wg.operand_permutation(k)])
    assert torch.equal(got.global_decode, want.global_decode)
    plain = act_quant.activation_operand(y1, dynamic_channels=32, gated=True, row_valid=valid, order="wgmma")
    assert not torch.equal(got.values, plain.values)
