"""Rollout MoE block (W4A4 + RAC experts): reference semantics, Triton path (TRITON_INTERPRET=1)."""

import dataclasses

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.errors import RACPlanError
from quads_megatron.kernels import act_quant, gemm_triton, tile_configs
from quads_megatron.nvfp4 import NVFP4InputError
from quads_megatron.rollout import rac_plan, reference
from quads_megatron.rollout.moe_block import ExpertWeights, GemmRAC, LayerRAC, moe_w4a4, route

E, H, INTER, T, TOPK = 4, 64, 32, 11, 2


def experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = [], []
    for e in range(E):
        gate, up = torch.randn(INTER, H, generator=g) * 0.05 * (e + 1), torch.randn(INTER, H, generator=g) * 0.1
        amax = nvfp4.shared_amax(gate, up)  # the contract: gate and up share one global scale
        w13.append(nvfp4.quantize(torch.cat([gate, up]), global_amax=amax))
        w2.append(nvfp4.quantize(torch.randn(H, INTER, generator=g) * 0.05))
    c13, s13, d13 = gemm_triton.stack_expert_weights(w13)
    c2, s2, d2 = gemm_triton.stack_expert_weights(w2)
    return ExpertWeights(c13, s13, d13, c2, s2, d2), w13, w2


def routing(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * torch.exp(torch.randn(H, generator=g))).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)])
    w = torch.softmax(torch.randn(T, TOPK, generator=g), -1)
    return x, ids, w


def per_token_loop(x, ids, tw, w13, w2, rac):
    """Independent spelling: each (token, slot) on its own through w4a4_linear_reference."""
    out = torch.zeros(T, H)
    for t in range(T):
        for j in range(TOPK):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            qa = reference.quantize_activation(x[t : t + 1], rac.fc1.plan, None, rac.fc1.dynamic_channels)
            y1 = reference.w4a4_linear_reference(qa, w13[e]).bfloat16().float()
            h = (torch.nn.functional.silu(y1[:, :INTER]) * y1[:, INTER:]).bfloat16()
            qh = reference.quantize_activation(h, rac.fc2.plan, None, rac.fc2.dynamic_channels)
            out[t] += tw[t, j] * reference.w4a4_linear_reference(qh, w2[e])[0].bfloat16().float()
    return out.bfloat16()


RACS = {
    "plain": LayerRAC(),
    "static": LayerRAC(
        GemmRAC(rac_plan.RACPlan(torch.tensor([0, 3]), H)), GemmRAC(rac_plan.RACPlan(torch.tensor([1]), INTER))
    ),
    "dynamic": LayerRAC(GemmRAC(dynamic_channels=32), GemmRAC(dynamic_channels=16)),
}


@pytest.mark.parametrize("rac", list(RACS))
def test_reference_equals_per_token_loop(rac):
    weights, w13, w2 = experts()
    x, ids, tw = routing()
    ids[2, 1] = -1  # a slot routed to another EP rank's expert
    got = moe_w4a4(x, ids, tw, weights, RACS[rac], impl="reference")
    assert torch.allclose(got.float(), per_token_loop(x, ids, tw, w13, w2, RACS[rac]).float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rac", list(RACS))
def test_triton_path_matches_reference(rac, dtype):
    weights, _, _ = experts()
    x, ids, tw = routing()
    x = x.to(dtype)
    ids[0, 0] = E  # out of range: ignored like -1
    ref = moe_w4a4(x, ids, tw, weights, RACS[rac], impl="reference")
    got = moe_w4a4(x, ids, tw, weights, RACS[rac].on("cpu"), impl="triton")
    assert got.dtype == ref.dtype == dtype
    ref, got = ref.float(), got.float()
    # same quantization; fc1 sums differ in order (fp32 vs fp64), so bf16 roundings may differ by 1 ulp
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(got, moe_w4a4(x, ids, tw, weights, RACS[rac].on("cpu"), impl="triton").float())  # deterministic


def test_routing_path_by_rows_unless_forced(monkeypatch):
    """The kernel paths route inside fc1's quantization launch up to FUSED_ROUTING_MAX_ROWS (T*k), in the
    routing kernel's own launch up to KERNEL_ROUTING_MAX_ROWS, then in the chunked routing's two launches;
    QUADS_ROUTING forces a path (the one-launch kernel up to its ROUTE_MAX_ROWS); another value, or a
    one-launch path past its limit, is an error."""
    from quads_megatron.kernels.route import ROUTE_MAX_ROWS
    from quads_megatron.rollout import moe_block

    limit = moe_block.FUSED_ROUTING_MAX_ROWS
    monkeypatch.delenv("QUADS_ROUTING", raising=False)
    kernel = moe_block.KERNEL_ROUTING_MAX_ROWS
    assert limit < kernel <= ROUTE_MAX_ROWS
    got = [moe_block.routing_path(n) for n in (limit, limit + 1, kernel, kernel + 1, ROUTE_MAX_ROWS + 1)]
    assert got == ["fused", "kernel", "kernel", "chunked", "chunked"]
    for path in moe_block.ROUTING_PATHS:
        monkeypatch.setenv("QUADS_ROUTING", path)
        assert moe_block.routing_path(limit + 1) == path
    monkeypatch.setenv("QUADS_ROUTING", "kernel")
    assert moe_block.routing_path(ROUTE_MAX_ROWS) == "kernel"
    with pytest.raises(ValueError, match="QUADS_ROUTING=kernel routes at most"):
        moe_block.routing_path(ROUTE_MAX_ROWS + 1)
    monkeypatch.setenv("QUADS_ROUTING", "yes")
    with pytest.raises(ValueError, match="QUADS_ROUTING must be one of"):
        moe_block.routing_path(1)


@pytest.mark.parametrize("rac", ["plain", "dynamic"])
def test_every_routing_path_gives_the_same_block(monkeypatch, rac):
    """The block routed in fc1's launch, by the routing kernel, by the chunked routing (its pos feeds the
    combine) and by torch ops: the same bits, foreign slots included."""
    weights, _, _ = experts()
    x, ids, tw = routing()
    ids[3, 1] = -1  # a slot of another EP rank
    outs = {}
    for path in ("fused", "kernel", "chunked", "torch"):
        monkeypatch.setenv("QUADS_ROUTING", path)
        outs[path] = moe_w4a4(x, ids, tw, weights, RACS[rac], impl="triton")
    for path, out in outs.items():
        assert torch.equal(out, outs["torch"]), path


def test_fc2_builds_its_own_row_tiles_where_its_tiles_differ(monkeypatch):
    """fc1's quantization launch (which also routes, at decode sizes) writes the row tiles both GEMMs share;
    where fc2's GEMM runs other tiles (here forced: 32-row tiles for K=INTER), fc2's quantization launch
    writes its own, and the block is the same bit for bit."""
    weights, _, _ = experts()
    x, ids, tw = routing()
    monkeypatch.setenv("QUADS_ROUTING", "kernel")
    shared = moe_w4a4(x, ids, tw, weights, impl="triton")  # the routing kernel's own launch
    monkeypatch.setenv("QUADS_ROUTING", "fused")
    assert torch.equal(moe_w4a4(x, ids, tw, weights, impl="triton"), shared)  # routed in fc1's launch: same bits
    config = tile_configs.triton_gemm_config
    monkeypatch.setattr(
        tile_configs,
        "triton_gemm_config",
        lambda rows, k, device=None: dataclasses.replace(config(rows, k, device), block_m=32 if k == INTER else 16),
    )
    launches = []
    operand = act_quant.activation_operand
    monkeypatch.setattr(
        act_quant, "activation_operand", lambda *a, **kw: launches.append(kw) or operand(*a, **kw)
    )
    assert torch.equal(moe_w4a4(x, ids, tw, weights, impl="triton"), shared)
    fc1, fc2 = launches
    assert fc1["route"][1:] == (E, 16) and fc1["route"][0] is ids and "row_tiles" not in fc1
    assert fc2["row_tiles"][1:] == (32, T * TOPK)


def test_rac_brings_the_moe_block_closer_to_the_trainer():
    """The trainer computes x @ qdq(W)^T with BF16 activations; RAC shrinks the W4A4 gap to it."""
    weights, w13, w2 = experts()
    x, ids, tw = routing()
    trainer = torch.zeros(T, H)
    for t in range(T):
        for j in range(TOPK):
            e = int(ids[t, j])
            y1 = (x[t].float() @ w13[e].dequantize().t()).bfloat16().float()
            h = (torch.nn.functional.silu(y1[:INTER]) * y1[INTER:]).bfloat16().float()
            trainer[t] += tw[t, j] * (h @ w2[e].dequantize().t())
    gap = {k: (moe_w4a4(x, ids, tw, weights, r).float() - trainer).norm().item() for k, r in RACS.items()}
    assert gap["dynamic"] < gap["plain"] and gap["static"] < gap["plain"]


def test_empty_batch():
    weights, _, _ = experts()
    x = torch.zeros(0, H, dtype=torch.bfloat16)
    ids, tw = torch.zeros(0, TOPK, dtype=torch.long), torch.zeros(0, TOPK)
    for impl in ("reference", "triton"):
        assert moe_w4a4(x, ids, tw, weights, RACS["dynamic"], impl=impl).shape == (0, H)


def test_routing_and_bad_inputs():
    order, offs, valid = route(torch.tensor([[1, 0], [1, -1]]), 2)
    assert offs.tolist() == [1, 3] and order.tolist()[:3] == [1, 0, 2] and valid.tolist() == [True, True, True, False]
    weights, _, _ = experts()
    x, ids, tw = routing()
    with pytest.raises(ValueError, match="hidden states"):
        moe_w4a4(x[:, :32], ids, tw, weights)
    with pytest.raises(ValueError, match="topk ids"):
        moe_w4a4(x, ids[:, :1], tw, weights)
    with pytest.raises(ValueError, match="not supported"):
        moe_w4a4(x, ids, tw, weights, activation="relu")
    with pytest.raises(RACPlanError, match="not both"):
        GemmRAC(rac_plan.RACPlan(torch.tensor([0]), H), 16)
    with pytest.raises(ValueError, match="w2_sdec"):
        ExpertWeights(
            weights.w13_codes,
            weights.w13_scales,
            weights.w13_sdec,
            weights.w2_codes,
            weights.w2_scales,
            weights.w2_sdec[:2],
        )
    xi = x.clone()
    xi[0, 0] = float("nan")
    with pytest.raises(NVFP4InputError, match="NaN"):
        moe_w4a4(xi, ids, tw, weights)
