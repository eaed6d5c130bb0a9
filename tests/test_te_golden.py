"""The contract and its Triton twin against Transformer Engine 2.20.2's reference NVFP4 quantizer.

tests/data/te_nvfp4_golden.safetensors holds TE's own results (NVFP4QuantizerRef run on CPU from the TE
wheel by dev/te_reference_golden.py): plain, row-scaled, and 4over6 (MAE / MSE, e4m3_max 448 / 256, per
tensor and per row) on random, heavy-tailed, zero, tie, saturating, subnormal-scale, E4M3-rounding-boundary
and summation-order-sensitive inputs. Codes and block scales must be identical; the error against the
input must be TE's up to the few-ulp difference between our S_dec = 1 / S_enc and TE's amax / (6 * e4m3_max).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quads_megatron import nvfp4
from quads_megatron.kernels import nvfp4_quant

GOLDEN = Path(__file__).parent / "data" / "te_nvfp4_golden.safetensors"
#: sha256 of transformer_engine-2.20.2-py3-none-any.whl, the wheel the vectors come from
TE_WHEEL_SHA256 = "7dcfad943a1a55b2612db9a0e43697fe98c70f4c42ec391ba3a0f872f6ce2094"


def _load() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(GOLDEN), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


TENSORS, META = _load()
VARIANTS: dict[str, dict] = json.loads(META["variants"])
CASES = sorted({k.split(".")[0] for k in TENSORS})


def variant_args(variant: str) -> tuple[str, nvfp4.NVFP4Recipe]:
    """(scale_mode, recipe) of one of TE's quantizer settings."""
    kw = VARIANTS[variant]
    recipe = nvfp4.NVFP4Recipe(
        use_4over6=kw.get("nvfp4_use_4over6", False),
        e4m3_max=kw.get("nvfp4_e4m3_max", 448),
        err_mode=kw.get("nvfp4_4over6_err_mode", "MAE"),
    )
    return ("row" if kw.get("row_scaled_nvfp4", False) else "tensor"), recipe


def golden(case: str, variant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, TE codes [M, K/2], TE scale bytes [M, K/16], TE amax [1] or [M], TE error sums fp64 [2])."""
    p = f"{case}.{variant}"
    return (
        TENSORS[f"{case}.x"],
        TENSORS[f"{p}.data"],
        TENSORS[f"{p}.scale"],
        TENSORS[f"{p}.amax"],
        TENSORS[f"{p}.err"],
    )


def assert_same_as_te(q: nvfp4.NVFP4Tensor, data: torch.Tensor, scale: torch.Tensor, where: str) -> None:
    codes = q.codes.reshape(data.shape)
    scales = q.block_scales.view(torch.uint8).reshape(scale.shape)
    assert torch.equal(codes, data), f"{where}: {(codes != data).sum().item()} code bytes differ from TE"
    assert torch.equal(scales, scale), f"{where}: {(scales != scale).sum().item()} block scales differ from TE"


def te_decode(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, e4m3_max: int) -> torch.Tensor:
    """TE's decode ((value(q) * s_b) * amax) / (6 * e4m3_max), fp32 [M, K] (as its reference's 4over6 error)."""
    vals = nvfp4.e2m1_decode(nvfp4.unpack_e2m1(data))
    m, k = vals.shape
    v = vals.view(m, k // 16, 16) * scale.view(torch.float8_e4m3fn).float().view(m, k // 16, 1)
    v = v * (amax.view(-1, 1, 1) if amax.numel() > 1 else amax)
    return (v / torch.tensor(6.0 * e4m3_max)).view(m, k)


def test_golden_file_is_tes():
    assert META["generator"] == "dev/te_reference_golden.py"
    assert META["wheel_sha256"] == TE_WHEEL_SHA256
    assert "reference_nvfp4.py" in META["source"]
    assert len(VARIANTS) == 10 and len(CASES) >= 20
    assert sum(k.endswith(".data") for k in TENSORS) == len(VARIANTS) * len(CASES)
    assert GOLDEN.stat().st_size < 2 << 20


def test_golden_cases_exercise_4over6():
    """The vectors would catch a 4over6 that always picked one candidate: both picks occur, MAE and MSE
    disagree somewhere, and ties (equal error) exist and go to map-to-6."""
    picks4 = picks6 = mae_vs_mse = 0
    for case in CASES:
        for emax in (448, 256):
            mae = golden(case, f"fos_mae_{emax}")[2]
            mse = golden(case, f"fos_mse_{emax}")[2]
            x = TENSORS[f"{case}.x"].reshape(-1, TENSORS[f"{case}.x"].shape[-1]).float()
            _, recipe = variant_args(f"fos_mae_{emax}")
            s_enc = nvfp4.global_encode_scale(x.abs().amax(), recipe)
            base = torch.div(x.reshape(x.shape[0], -1, 16).abs().amax(-1), 6.0) * s_enc
            map6 = nvfp4.e4m3_rne(base).view(torch.uint8)
            map4 = nvfp4.e4m3_rne(base * 1.5).view(torch.uint8)
            differ = map4 != map6
            picks4 += int(((mae == map4) & differ).sum())
            picks6 += int(((mae == map6) & differ).sum())
            mae_vs_mse += int((mae != mse).sum())
    assert picks4 > 100 and picks6 > 100 and mae_vs_mse > 10
    # the tie rows: elements exactly representable under both candidates pick map-to-6 (TE: strict <)
    x, _, scale, _, _ = golden("ties_448_6x32", "fos_mae_448")
    assert x[2, :16].tolist() == [6.0, 3.0, 0.0, -6.0] * 4
    assert scale.view(torch.float8_e4m3fn)[2, 0].item() == 1.0  # map-to-6 (map-to-4 would be 1.5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_contract_is_bit_exact_against_te(variant):
    mode, recipe = variant_args(variant)
    for case in CASES:
        x, data, scale, amax, _ = golden(case, variant)
        q = nvfp4.quantize(x, mode, recipe=recipe)
        assert_same_as_te(q, data, scale, f"{case} {variant}")
        assert torch.equal(nvfp4.amax(x, mode).reshape(-1), amax)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_triton_twin_is_bit_exact_against_te(variant):
    mode, recipe = variant_args(variant)
    for case in CASES:
        x, data, scale, _, _ = golden(case, variant)
        block_k = 64 if x.shape[-1] % 64 == 0 else 32
        q = nvfp4_quant.quantize(x, mode, recipe=recipe, block_m=8, block_k=block_k)
        assert_same_as_te(q, data, scale, f"{case} {variant} (Triton)")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_error_against_the_input_is_tes(variant):
    """sum |x_hat - x| and sum (x_hat - x)^2 of our dequantization equal TE's (stored by the generator from
    its own decode) up to the bound the S_dec difference allows: every element of x_hat is within two fp32
    ulps of TE's decode (S_dec = 1 / S_enc is within 1.5 ulps of amax / (6 * e4m3_max), plus one rounding
    each way)."""
    mode, recipe = variant_args(variant)
    for case in CASES:
        x, data, scale, amax, te_err = golden(case, variant)
        x2 = x.reshape(-1, x.shape[-1]).double()
        dq = nvfp4.dequantize(nvfp4.quantize(x, mode, recipe=recipe)).reshape(x2.shape)
        te = te_decode(data, scale, amax, recipe.e4m3_max)
        ulp = torch.ldexp(torch.ones_like(te), torch.frexp(te).exponent - 24)  # one fp32 ulp of te
        ulp = 2 * ulp
        assert bool(((dq - te).abs() <= ulp).all()), f"{case} {variant}: dequantization > 2 ulps from TE's decode"
        d = dq.double() - x2
        err = torch.stack([d.abs().sum(), d.square().sum()])
        u = ulp.double()
        bound = torch.stack([u.sum(), ((2 * (te.double() - x2).abs() + u) * u).sum()]) + 1e-30
        assert bool(((err - te_err).abs() <= bound).all()), f"{case} {variant}: error {err.tolist()} vs TE {te_err}"


def test_plain_and_row_are_the_default_contract():
    """The default recipe and recipe=None are plain NVFP4: TE's 'plain' and 'row' vectors unchanged."""
    for case in CASES:
        for variant, mode in (("plain", "tensor"), ("row", "row")):
            x, data, scale, _, _ = golden(case, variant)
            assert_same_as_te(nvfp4.quantize(x, mode), data, scale, f"{case} {variant} (recipe=None)")
            assert nvfp4.quantize(x, mode).same_bits(nvfp4.quantize(x, mode, recipe=nvfp4.NVFP4Recipe()))


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if VARIANTS[v].get("row_scaled_nvfp4")))
def test_rollout_activations_are_tes_row_scaled_activations(variant):
    """The rollout's dynamic per-token activation scale is TE's row_scaled_activation (row_scaled_nvfp4):
    torch reference and Triton act_quant give TE's codes and block scales for every 2-D case."""
    from quads_megatron.kernels import act_quant
    from quads_megatron.kernels.tile_configs import ActQuantConfig
    from quads_megatron.rollout import reference

    _, recipe = variant_args(variant)
    checked = 0
    for case in CASES:
        x, data, scale, _, _ = golden(case, variant)
        if x.dim() != 2:
            continue
        assert_same_as_te(reference.quantize_activation(x, recipe=recipe).x, data, scale, f"{case} {variant}")
        tiles = ActQuantConfig(block_m=8, block_k=64 if x.shape[1] % 64 == 0 else 32)
        q = act_quant.quantize_activation(x, config=tiles, recipe=recipe).x
        assert_same_as_te(q, data, scale, f"{case} {variant} (act_quant)")
        checked += 1
    assert checked >= 20
