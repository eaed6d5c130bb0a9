"""The fused pieces of the Triton MoE block against their unfused torch spelling (TRITON_INTERPRET=1 on CPU):
token-indexed fc1 operand rows, SiLU*up fused into fc2's activation quantization, the top-k combine
kernel, and the on-device tile schedule."""

import pytest
import torch
from quads_megatron.kernels import moe_combine
from quads_megatron.kernels import w4a4_grouped as kg

from quads_megatron import nvfp4, w4a4
from quads_megatron.moe_w4a4 import combine, gated_activation, route
from quads_megatron.nvfp4 import NVFP4InputError

E, K, N, T, TOPK = 5, 64, 32, 13, 3


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K, generator=g) * torch.exp(torch.randn(K, generator=g))).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)])
    ids[2, 1] = -1  # a foreign expert (another EP rank)
    ws = [nvfp4.quantize(torch.randn(N, K, generator=g) * 0.05) for _ in range(E)]
    return g, x, ids, ws


@pytest.mark.parametrize("rac", ["none", "plan"])
def test_token_indexed_rows_equal_the_gathered_operand(rac):
    g, x, ids, ws = _setup()
    order, offs, _ = route(ids, E)
    tokens = order // TOPK
    plan = w4a4.RACPlan(torch.tensor([1, 2]), K) if rac == "plan" else None
    wc, wsc, wsd = kg.stack_expert_weights(ws)
    op = kg.activation_operand(x, plan)
    gathered = kg.ActivationOperand(op.values[tokens], op.global_decode[tokens])
    cfg = dict(block_m=16, block_n=32, block_k=64)
    want = kg.grouped_w4a4(gathered, offs, wc, wsc, wsd, **cfg)
    got = kg.grouped_w4a4(op, offs, wc, wsc, wsd, a_rows=tokens, **cfg)
    n = int(offs[-1])  # rows of local experts (the foreign slot's row after them is not computed)
    assert got.shape == (T * TOPK, N) and n == T * TOPK - 1 and torch.equal(got[:n], want[:n])
    qa = kg.quantize_activation(x, plan)  # the codes path takes the same index
    qg = w4a4.QuantizedActivation(
        nvfp4.NVFP4Tensor(qa.x.codes[tokens], qa.x.block_scales[tokens], qa.x.global_decode[tokens]),
        None
        if qa.residual is None
        else nvfp4.NVFP4Tensor(
            qa.residual.codes[tokens], qa.residual.block_scales[tokens], qa.residual.global_decode[tokens]
        ),
    )
    mask = None if plan is None else plan.block_mask("cpu")
    assert torch.equal(
        kg.grouped_w4a4(qa, offs, wc, wsc, wsd, mask, a_rows=tokens, **cfg)[:n],
        kg.grouped_w4a4(qg, offs, wc, wsc, wsd, mask, **cfg)[:n],
    )
    with pytest.raises(NVFP4InputError, match="a_rows"):
        kg.grouped_w4a4(op, offs, wc, wsc, wsd, a_rows=tokens.float(), **cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rac", ["none", "plan", "dynamic"])
def test_gated_operand_equals_quantizing_the_gated_activation(dtype, rac):
    g = torch.Generator().manual_seed(3)
    m, i = 37, 48
    y1 = (torch.randn(m, 2 * i, generator=g) * 3).to(dtype)
    valid = torch.rand(m, generator=g) > 0.2
    h = torch.where(valid[:, None], gated_activation(y1), 0.0)
    kw = {"none": {}, "plan": {"plan": w4a4.RACPlan(torch.tensor([0, 2]), i)}, "dynamic": {"dynamic_channels": 16}}
    want = kg.activation_operand(h, **kw[rac])
    got = kg.activation_operand(y1, gated=True, row_valid=valid, **kw[rac])
    assert got.values.shape == (m, 2, i // 2)
    assert torch.equal(got.global_decode, want.global_decode)
    assert torch.equal(got.values, want.values)
    assert torch.equal(got.values[~valid], torch.zeros_like(got.values[~valid]))
    with pytest.raises(NVFP4InputError, match="gated"):
        kg.activation_operand(y1.float(), gated=True)
    with pytest.raises(NVFP4InputError, match="row_valid"):
        kg.activation_operand(y1, gated=True, row_valid=valid[:-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_combine_kernel_equals_the_torch_combine(dtype):
    g, _, ids, _ = _setup(4)
    order, _, valid = route(ids, E)
    y = (torch.randn(T * TOPK, 40, generator=g) * 4).bfloat16()
    tw = torch.softmax(torch.randn(T, TOPK, generator=g), -1)
    want = combine(y, order, valid, tw).to(dtype)
    got = moe_combine.combine(y, order, ids, tw, E, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(got[2], (tw[2, [0, 2], None] * y[order.argsort()][[6, 8]].float()).sum(0).to(dtype))
    with pytest.raises(NVFP4InputError, match="combine"):
        moe_combine.combine(y[:-1], order, ids, tw, E, dtype)


def test_tile_schedule():
    offs = torch.tensor([0, 3, 3, 40, 41], dtype=torch.int32)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    want = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum((counts + 15) // 16, 0).to(torch.int32)])
    assert torch.equal(kg.tile_starts(offs, 16), want)
    assert kg.tile_starts(offs, 16).tolist() == [0, 0, 1, 1, 4, 5]
