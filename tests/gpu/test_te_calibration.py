"""RAC calibration hooks on a real TEGroupedMLP MoE layer (Transformer Engine, BF16, H200).

Mirrors tests/test_calibration.py (SequentialMLP on CPU): what record_expert_inputs records for fc1
(every token once per expert it is routed to) and fc2 (act(gate) * up of fc1's output, what the
rollout's fc2 quantizes) equals what we compute independently from the router's routing map and the
layer's per-expert weight{i}, with and without QAT on the weights.

fc1's rows are the layer's own BF16 tokens, so their row count and amax match exactly and their
residual scores up to fp32 summation order. fc2's rows come out of TE's grouped GEMM, ours out of a
torch BF16 GEMM of the same operands: a BF16 output may differ by one ulp where the two kernels
accumulate in different orders, and an NVFP4 rounding near a decision boundary then moves a block's
residual, so those statistics are compared with a 2% tolerance (recording fc2's real input instead,
act(gate) * up * router prob, would be off by the squared probabilities, tens of percent).
"""

from __future__ import annotations

import pytest
import torch
from megatron_model import build_moe_layer, grouped_expert_weights, init_megatron, moe_layer_config, te_skip_reason

import quads_megatron
from quads_megatron import fake_quant, nvfp4
from quads_megatron.config import RACConfig
from quads_megatron.integrations.megatron import calibration as megatron_calibration
from quads_megatron.rollout import moe_block, reference

TE_SKIP = te_skip_reason()
pytestmark = pytest.mark.skipif(TE_SKIP is not None, reason=TE_SKIP or "")

E, H, F, TOPK = 8, 256, 128, 2


@pytest.fixture(scope="module", autouse=True)
def world():
    init_megatron()
    yield


@pytest.fixture(autouse=True)
def clean():
    quads_megatron.remove()
    fake_quant.reset_stats()
    yield
    quads_megatron.remove()


def tokens(seed: int, n: int = 48) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, 1, H, generator=g, device="cuda")
    x[..., 16:32] *= 30  # one hot block: every plan of fc1's input must take block 1
    return x.bfloat16()


def expected(layer, xs, qat: bool) -> dict[str, list[torch.Tensor]]:
    """fc1 rows and act(gate) * up of fc1's output, per expert, from the router's routing map and the
    experts' weight{i} (qdq'd under QAT)."""
    out = {"w13": [], "w2": []}
    w1s = grouped_expert_weights(layer, "fc1")
    with torch.no_grad():
        for x in xs:
            flat = x.reshape(-1, H)
            _, routing_map = layer.router(x)
            for e, w1 in enumerate(w1s):
                rows = flat[routing_map[:, e]]
                w = nvfp4.qdq(w1.detach()) if qat else w1.detach()
                out["w13"].append(rows)
                out["w2"].append(moe_block.gated_activation(rows @ w.t(), "silu"))
    return out


@pytest.mark.parametrize("qat", [False, True])
def test_te_grouped_hooks_record_what_the_rollout_gemms_quantize(qat):
    if qat:
        quads_megatron.apply()
    layer = build_moe_layer(moe_layer_config(E, H, F, TOPK), layer_number=3)
    assert type(layer.experts).__name__ == "TEGroupedMLP"
    xs = [tokens(1), tokens(2)]
    with torch.no_grad():
        with megatron_calibration.record_expert_inputs(layer) as cal:
            for x in xs:
                layer(x)
        layer(tokens(3))  # after the with: no hook left, nothing recorded
    if qat:
        assert fake_quant.STATS.qdq_calls == 2 * E  # the hooks saw fc1 with QDQ'd weights
    want = expected(layer, xs, qat)
    prefix = "model.layers.2.mlp.experts"  # layer_number 3 -> HF index 2
    assert sorted(cal.stats) == [f"{prefix}.w13", f"{prefix}.w2"]
    for gemm, rtol in (("w13", 1e-4), ("w2", 2e-2)):
        rows = torch.cat(want[gemm])
        name = f"{prefix}.{gemm}"
        assert cal.tokens[name] == rows.shape[0] == 2 * 48 * TOPK
        assert cal.amax[name] == pytest.approx(float(rows.abs().max()), rel=1e-6 if gemm == "w13" else 1e-2)
        got, ref = cal.stats[name], reference.residual_block_scores(rows).sum(0).cpu()
        rel = float(((got - ref).abs() / ref.abs().clamp_min(1e-30)).max())
        print(f"[te_calibration] qat={qat} {gemm}: max relative stat diff {rel:.2e} (tolerance {rtol})")
        torch.testing.assert_close(got, ref, rtol=rtol, atol=1e-6)
    plans = cal.plans(RACConfig(ratio=0.25).num_channels)
    assert plans[f"{prefix}.w13"].num_channels == H // 4 and 1 in plans[f"{prefix}.w13"].blocks.tolist()
    assert plans[f"{prefix}.w2"].k == F
