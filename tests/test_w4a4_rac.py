"""Rollout W4A4 + RAC: reference semantics, Triton twins (TRITON_INTERPRET=1), calibration."""

import pytest
import torch
import triton
import triton.language as tl

from quads_megatron import nvfp4
from quads_megatron.config import RACConfig
from quads_megatron.errors import RACPlanError
from quads_megatron.kernels import act_quant, fp4_device, gemm_triton
from quads_megatron.kernels.tile_configs import ActQuantConfig, TritonGemmConfig
from quads_megatron.nvfp4 import NVFP4InputError
from quads_megatron.rollout import calibration, rac_plan, reference


def outlier_activations(m, k, dtype=torch.bfloat16):
    """Activations with heavy-tailed per-channel magnitudes (a few outlier channels)."""
    return (torch.randn(m, k) * torch.exp(torch.randn(k) * 1.2)).to(dtype)


def test_plain_w4a4_is_per_token_contract_quantization():
    x = outlier_activations(8, 64)
    qa = reference.quantize_activation(x)
    assert qa.residual is None
    assert qa.x.same_bits(nvfp4.quantize(x, "row"))
    static = reference.quantize_activation(x, static_amax=torch.tensor(50.0))
    assert static.x.same_bits(nvfp4.quantize(x, "row", torch.full((8, 1), 50.0)))
    assert torch.all(static.x.global_decode == nvfp4.input_scale_from_amax(torch.tensor(50.0)))


def test_residual_is_quantized_on_selected_blocks_with_the_token_scale():
    x = outlier_activations(6, 96)
    plan = rac_plan.RACPlan(torch.tensor([1, 4]), 96)
    qa = reference.quantize_activation(x, plan)
    assert torch.equal(qa.residual.global_decode, qa.x.global_decode)  # one alpha per row
    r = x.float() - nvfp4.dequantize(qa.x)
    r_sel = torch.zeros_like(r)
    for b in (1, 4):
        r_sel[:, 16 * b : 16 * b + 16] = r[:, 16 * b : 16 * b + 16]
    assert qa.residual.same_bits(nvfp4.quantize(r_sel, "row", nvfp4.amax(x, "row")))
    off = qa.residual.block_scales.float().clone()
    off[:, [1, 4]] = 0
    assert torch.all(off == 0)


def test_augmented_gemm_reuses_weight_codes_and_matches_explicit_concat():
    x = outlier_activations(5, 64)
    w = nvfp4.quantize(torch.randn(24, 64) * 0.05)
    plan = rac_plan.RACPlan(torch.tensor([0, 3]), 64)
    qa = reference.quantize_activation(x, plan)
    y = reference.w4a4_linear_reference(qa, w)
    # explicit augmented-K operands built from the same codes and scales
    cols = torch.cat([torch.arange(0, 16), torch.arange(48, 64)])
    a_aug = torch.cat([nvfp4.dequantize(qa.x), nvfp4.dequantize(qa.residual)[:, cols]], 1).double()
    w_aug = torch.cat([nvfp4.dequantize(w), nvfp4.dequantize(w)[:, cols]], 1).double()
    assert torch.allclose(y.double(), a_aug @ w_aug.t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ratio", [0.125, 0.25, 0.5, 1.0])
def test_rac_reduces_error_against_trainer_output(ratio):
    x = outlier_activations(64, 256, torch.float32)
    w = nvfp4.quantize(torch.randn(64, 256) * 0.05)
    trainer = x @ nvfp4.dequantize(w).t()  # what the QAT trainer computes: BF16 activations
    n = RACConfig(ratio=ratio).num_channels(256)
    plan = rac_plan.RACPlan.from_scores(reference.residual_block_scores(x).sum(0), n)
    err = lambda y: ((y - trainer).norm() / trainer.norm()).item()
    plain = err(reference.w4a4_linear_reference(reference.quantize_activation(x), w))
    rac = err(reference.w4a4_linear_reference(reference.quantize_activation(x, plan), w))
    assert rac < plain
    if ratio == 1.0:
        assert rac < plain / 4  # full compensation: two-term NVFP4 activation


def test_dynamic_per_token_selection():
    x = outlier_activations(8, 64)
    qa = reference.quantize_activation(x, dynamic_channels=16)
    xq = nvfp4.quantize(x, "row")
    r_amax = (x.float() - nvfp4.dequantize(xq)).reshape(8, 4, 16).abs().amax(-1)
    nonzero_blocks = (qa.residual.block_scales.float() != 0).sum(1)
    assert torch.all(nonzero_blocks <= 1) and nonzero_blocks.sum() > 4
    picked = qa.residual.block_scales.float().argmax(1)
    assert torch.equal(picked[nonzero_blocks == 1], r_amax.argmax(1)[nonzero_blocks == 1])
    # ties with the n-th largest are all compensated (one rule the kernel can follow exactly)
    r = torch.tensor([[[1.0] * 16, [3.0] * 16, [3.0] * 16, [0.5] * 16]])
    assert reference.dynamic_block_mask(r, 16).tolist() == [[False, True, True, False]]
    assert reference.dynamic_block_mask(r, 32).tolist() == [[False, True, True, False]]
    assert reference.dynamic_block_mask(r, 48).tolist() == [[True, True, True, False]]
    assert not reference.dynamic_block_mask(r, 0).any()
    with pytest.raises(RACPlanError, match="multiple of 16"):
        reference.quantize_activation(x, dynamic_channels=8)
    with pytest.raises(RACPlanError, match="not both"):
        reference.quantize_activation(x, rac_plan.RACPlan(torch.tensor([0]), 64), dynamic_channels=16)


def test_bad_inputs():
    with pytest.raises(RACPlanError, match="K=64"):
        reference.quantize_activation(torch.randn(2, 64), rac_plan.RACPlan(torch.tensor([0]), 32))
    with pytest.raises(RACPlanError, match="in \\[0, 2\\)"):
        rac_plan.RACPlan(torch.tensor([5]), 32)
    x = torch.randn(2, 32)
    x[0, 0] = float("inf")
    with pytest.raises(NVFP4InputError, match="Inf"):
        reference.quantize_activation(x)


def test_calibrator_plans():
    cal = calibration.RACCalibrator("residual")
    x = outlier_activations(32, 128, torch.float32)
    x[:, 32:48] *= 50  # a hot block
    cal.observe("layers.0.mlp.experts.fc1", x[:16])
    cal.observe("layers.0.mlp.experts.fc1", x[16:])
    plans = cal.plans(RACConfig(ratio=0.125).num_channels)
    plan = plans["layers.0.mlp.experts.fc1"]
    assert plan.num_channels == 16 and plan.blocks.tolist() == [2]
    assert cal.tokens["layers.0.mlp.experts.fc1"] == 32
    amax_cal = calibration.RACCalibrator("amax")
    amax_cal.observe("l", x)
    assert amax_cal.plans(lambda k: 16)["l"].blocks.tolist() == [2]


# ----------------------------------------------------------------------------- Triton twins


@pytest.mark.parametrize("blocks", [None, [0], [1, 2, 5], list(range(6))])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("block_k", [None, 32])  # whole row in registers / two passes over chunks
def test_triton_activation_quant_bit_identical(blocks, static, block_k):
    x = outlier_activations(20, 96)  # K=96: not a power of two, the single pass masks 128 -> 96
    x[3] = 0
    plan = None if blocks is None else rac_plan.RACPlan(torch.tensor(blocks), 96)
    amax = torch.tensor(7.5) if static else None
    a = reference.quantize_activation(x, plan, amax)
    b = act_quant.quantize_activation(x, plan, amax, ActQuantConfig(block_m=None if block_k else 8, block_k=block_k))
    assert a.x.same_bits(b.x)
    assert (a.residual is None) == (b.residual is None)
    if a.residual is not None:
        assert a.residual.same_bits(b.residual)


@pytest.mark.parametrize("channels", [16, 48, 96, 160])  # 160 > K: every block
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k, rows", [(96, 33), (4096, 4)])  # all-pairs rank (<= 128 blocks) / bisection
def test_triton_dynamic_rac_bit_identical(channels, static, k, rows):
    channels = channels if k == 96 else channels * 16
    x = outlier_activations(rows, k)
    x[3] = 0
    x[2, :16] = x[2, 16:32]  # equal residual amaxes: ties resolved by the same rule
    amax = torch.tensor(9.0) if static else None
    a = reference.quantize_activation(x, None, amax, dynamic_channels=channels)
    b = act_quant.quantize_activation(x, None, amax, ActQuantConfig(block_m=4), dynamic_channels=channels)
    assert a.x.same_bits(b.x) and a.residual.same_bits(b.residual)
    op = act_quant.activation_operand(x, None, amax, dynamic_channels=channels)
    exact = reference._exact_values
    want = ((exact(a.x) / 128).half().float() + (exact(a.residual) / 128).half()).half()
    assert torch.equal(op.values[:, 0], want[:, 0::2]) and torch.equal(op.values[:, 1], want[:, 1::2])
    with pytest.raises(ValueError, match="must cover K"):
        act_quant.quantize_activation(x, config=ActQuantConfig(block_k=32), dynamic_channels=16)


def folded_reference(x, offs, ws, plan):
    """What the kernel computes for RAC: fp16(A*2^-7) + fp16(R*2^-7) rounded in fp16, times W, in fp64."""
    out = torch.zeros(x.shape[0], ws[0].shape[0], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            qa = reference.quantize_activation(x[start:end], plan)
            a16 = (reference._exact_values(qa.x) / 128).half() + (reference._exact_values(qa.residual) / 128).half()
            y = (a16.double() * 128) @ reference._exact_values(ws[e]).double().t()
            out[start:end] = y * qa.x.global_decode.double() * ws[e].global_decode.double()
        start = end
    return out.float()


@pytest.mark.parametrize("experts", [4, 5, 8])
@pytest.mark.parametrize("rac_blocks", [None, [1, 3], list(range(8))])
def test_triton_grouped_gemm_matches_reference(rac_blocks, experts):
    e, n, k = experts, 32, 128
    x = outlier_activations(37, k)
    # uneven groups, empty experts included, rows reaching the last expert
    offs = torch.tensor(sorted(torch.randint(0, 38, (e - 1,)).tolist()) + [37])
    ws = [nvfp4.quantize(torch.randn(n, k) * 0.05 * (i + 1)) for i in range(e)]
    plan = None if rac_blocks is None else rac_plan.RACPlan(torch.tensor(rac_blocks), k)
    ref = reference.grouped_w4a4_reference(x, offs, ws, None if plan is None else [plan] * e)
    qa = act_quant.quantize_activation(x, plan)
    wc, wsc, wsd = gemm_triton.stack_expert_weights(ws)
    mask = None if plan is None else plan.block_mask()
    tiles16, tiles32 = TritonGemmConfig(block_n=16, block_k=64), TritonGemmConfig(block_n=32, block_k=32)
    y = gemm_triton.grouped_w4a4(qa, offs, wc, wsc, wsd, mask, out_dtype=torch.float32, config=tiles16)
    tol = ref.abs().max().item()
    if plan is None:  # exact products: only the fp32 summation order differs
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * tol)
    else:  # the fold (A + R) rounds in fp16 where the terms span > 11 bits: match that exactly,
        assert torch.allclose(y, folded_reference(x, offs, ws, plan), rtol=1e-5, atol=1e-5 * tol)
        assert ((y - ref).norm() / ref.norm()).item() < 2e-4  # and stay within 2e-4 of augmented K
    # the pre-decoded operand path does the same arithmetic: bit-identical output
    op = act_quant.activation_operand(x, plan)
    y_op = gemm_triton.grouped_w4a4(op, offs, wc, wsc, wsd, out_dtype=torch.float32, config=tiles16)
    assert torch.equal(y_op, y)
    y_bf16 = gemm_triton.grouped_w4a4(qa, offs, wc, wsc, wsd, mask, config=tiles32)
    assert y_bf16.dtype == torch.bfloat16  # rounded to nearest even (not truncated) from the fp32 result
    y32 = gemm_triton.grouped_w4a4(qa, offs, wc, wsc, wsd, mask, out_dtype=torch.float32, config=tiles32)
    assert torch.equal(y_bf16, y32.bfloat16())
    assert torch.allclose(y_bf16.float(), ref, rtol=1e-2, atol=1e-2 * tol)


def test_triton_grouped_gemm_checks_shapes():
    ws = [nvfp4.quantize(torch.randn(16, 64)) for _ in range(2)]
    wc, wsc, wsd = gemm_triton.stack_expert_weights(ws)
    qa = act_quant.quantize_activation(torch.randn(4, 128))
    with pytest.raises(ValueError, match="does not match weight K"):
        gemm_triton.grouped_w4a4(qa, torch.tensor([2, 4]), wc, wsc, wsd)
    qa = act_quant.quantize_activation(torch.randn(4, 64))
    with pytest.raises(ValueError, match="offs has 3 entries"):
        gemm_triton.grouped_w4a4(qa, torch.tensor([1, 2, 4]), wc, wsc, wsd)


@triton.jit
def _decode_probe(c_ptr, s_ptr, lo_ptr, hi_ptr, BR: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):
    rows = tl.arange(0, BR).to(tl.int64)
    lo, hi = fp4_device.load_decoded(c_ptr, s_ptr, rows, rows < BR, 0, BK, BR, BK, USE_ASM)
    offs = rows[:, None] * (BK // 2) + tl.arange(0, BK // 2)[None, :]
    tl.store(lo_ptr + offs, lo.to(tl.float32))
    tl.store(hi_ptr + offs, hi.to(tl.float32))


def check_tile_decode(use_asm: bool) -> bool:
    """fp4_device.load_decoded against the contract: value * s_b * 2^-7 for all 256 code bytes x 127
    finite E4M3 scales, bit for bit (benchmarks/bench_moe_w4a4.py runs the same check with PTX on a GPU)."""
    scales = torch.arange(128, dtype=torch.uint8).clamp(max=126).reshape(128, 1).repeat(1, 16)
    ok = True
    for half in (0, 1):
        codes = torch.arange(128 * half, 128 * half + 128, dtype=torch.uint8).reshape(1, 128).repeat(128, 1)
        lo, hi = torch.empty(128, 128), torch.empty(128, 128)
        _decode_probe[(1,)](codes, scales, lo, hi, BR=128, BK=256, USE_ASM=use_asm)
        want = nvfp4.dequantize(nvfp4.NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), torch.tensor(1.0))) / 128
        ok &= torch.equal(lo, want[:, 0::2]) and torch.equal(hi, want[:, 1::2])
    return bool(ok)


def test_gemm_tile_decode_is_exact_for_every_code_and_scale():
    """The in-register fp16 decode equals value * s_b * 2^-7 for all 256 code bytes x 127 E4M3 scales."""
    assert check_tile_decode(use_asm=False)
    from triton.errors import TritonError

    with pytest.raises(TritonError, match="inline_asm"):  # no PTX off the GPU: the check cannot pass vacuously
        check_tile_decode(use_asm=True)


@pytest.mark.parametrize("blocks", [None, [0, 2, 5]])
@pytest.mark.parametrize("block_k", [None, 32])
def test_activation_operand_is_the_decoded_codes(blocks, block_k):
    x = outlier_activations(9, 96)
    plan = None if blocks is None else rac_plan.RACPlan(torch.tensor(blocks), 96)
    qa = reference.quantize_activation(x, plan)
    op = act_quant.activation_operand(x, plan, config=ActQuantConfig(block_m=None if block_k else 4, block_k=block_k))
    want = (reference._exact_values(qa.x) / 128).half()
    if plan is not None:
        want = (want.float() + (reference._exact_values(qa.residual) / 128).half().float()).half()
    assert torch.equal(op.values[:, 0], want[:, 0::2]) and torch.equal(op.values[:, 1], want[:, 1::2])
    assert torch.equal(op.global_decode, qa.x.global_decode)
