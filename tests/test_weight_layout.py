"""The experts' tiled weight layout (kernels/weight_layout.py) every grouped GEMM reads: where each byte goes, the
round trip, the shapes it refuses, and the Triton GEMM's output on it (the same bits as on row-major weights,
under TRITON_INTERPRET=1 here; the Gluon GEMMs' on the GPU, tests/test_gpu_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.kernels import act_quant, gemm_triton
from quads_megatron.kernels.weight_layout import (
    CODE_CHUNK_BYTES,
    SCALE_CHUNK_BYTES,
    retile_,
    tile_weights,
    tiled_view,
    untile_weights,
    weight_dims,
)
from quads_megatron.rollout.moe_block import route


def _bytes(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    return codes, torch.randint(0, 256, (e, n, k // 16), dtype=torch.uint8, generator=g)


def test_tiled_weights_are_the_same_bytes_in_16_row_chunk_blocks():
    """Byte b of weight row n, expert e at [e, n // 16, b // 64, n % 16, b % 64] (scales: block j at [e, n // 16,
    j // 8, n % 16, j % 8]): each 16-row group's 128-K chunk one contiguous 1 KB (128 B) block, at the flat offset
    the kernels compute; untile_weights gives the row-major tensors back."""
    e, n, k = 3, 48, 384
    codes, scales = _bytes(e, n, k)
    tc, ts = tile_weights(codes, scales)
    assert tc.shape == (e, n // 16, k // 128, 16, 64) and ts.shape == (e, n // 16, k // 128, 16, 8)
    assert tc.is_contiguous() and ts.is_contiguous()
    for ei, row, b in [(0, 0, 0), (1, 17, 65), (2, 47, 191), (2, 31, 64)]:
        assert tc[ei, row // 16, b // 64, row % 16, b % 64] == codes[ei, row, b]
    for ei, row, j in [(0, 5, 7), (1, 16, 8), (2, 47, 23)]:
        assert ts[ei, row // 16, j // 8, row % 16, j % 8] == scales[ei, row, j]
    flat = tc.reshape(-1)  # the kernels' offset: (e*N + n) // 16 * 16 * K/2 + b // 64 * 1024 + n % 16 * 64 + b % 64
    for ei, row, b in [(1, 17, 65), (2, 47, 191)]:
        g = ei * n + row
        assert flat[g // 16 * 16 * (k // 2) + b // 64 * 1024 + g % 16 * 64 + b % 64] == codes[ei, row, b]
    assert weight_dims(tc, ts) == (e, n, k, True) and weight_dims(codes, scales) == (e, n, k, False)
    back = untile_weights(tc, ts)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)


def test_shapes_the_layout_cannot_hold_are_refused():
    codes, scales = _bytes(2, 48, 256)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        tile_weights(codes[:, :40], scales[:, :40])
    with pytest.raises(ValueError, match="K % 128 == 0"):
        tile_weights(codes[:, :, :32], scales[:, :, :8])
    tc, ts = tile_weights(codes, scales)
    with pytest.raises(ValueError, match="tiled weights must be"):
        weight_dims(tc, ts[..., :4])
    with pytest.raises(ValueError, match="contiguous"):
        weight_dims(tc.transpose(3, 4).contiguous().transpose(3, 4), ts)
    with pytest.raises(ValueError, match="weights must be codes"):
        weight_dims(codes[0], scales[0])


@pytest.mark.parametrize("scratch_slabs", [1, 2, 5])
def test_retile_in_place_is_tile_weights_expert_by_expert(scratch_slabs):
    """retile_ permutes each expert's slab in its own storage into tile_weights' bytes (tiled_view: the 5-D
    shape, no copy) and back, any run of experts alone, through a scratch of whole slabs (several passes when
    it holds fewer slabs than the run)."""
    e, n, k = 5, 32, 256
    codes, scales = _bytes(e, n, k)
    tc, ts = tile_weights(codes, scales)
    c, s = codes.clone(), scales.clone().view(torch.float8_e4m3fn)  # the SGLang parameters' dtypes
    ptrs = (c.data_ptr(), s.data_ptr())
    for x, chunk in ((c, CODE_CHUNK_BYTES), (s, SCALE_CHUNK_BYTES)):
        scratch = torch.empty(scratch_slabs * x[0].numel(), dtype=torch.uint8)
        retile_(x, chunk, tiled=True, scratch=scratch)
    assert (c.data_ptr(), s.data_ptr()) == ptrs and c.shape == codes.shape
    assert torch.equal(tiled_view(c, CODE_CHUNK_BYTES), tc)
    assert torch.equal(tiled_view(s.view(torch.uint8), SCALE_CHUNK_BYTES), ts)
    retile_(c, CODE_CHUNK_BYTES, tiled=False, first=1, count=2)
    assert torch.equal(c[1:3], codes[1:3]) and torch.equal(tiled_view(c, CODE_CHUNK_BYTES)[3:], tc[3:])
    assert torch.equal(tiled_view(c, CODE_CHUNK_BYTES)[:1], tc[:1])
    retile_(c, CODE_CHUNK_BYTES, tiled=False, count=1)
    retile_(c, CODE_CHUNK_BYTES, tiled=False, first=3)
    assert torch.equal(c, codes)


def test_retile_refuses_what_it_cannot_permute_before_writing():
    codes, _ = _bytes(3, 32, 256)
    before = codes.clone()
    for bad, kwargs, pattern in (
        (codes[:, :24], {}, "N % 16 == 0"),
        (codes[:, :, :96], {}, "B % 64 == 0"),
        (codes.float(), {}, "1-byte"),
        (codes.transpose(1, 2), {}, "contiguous"),
        (codes, {"first": 2, "count": 2}, "not within"),
        (codes, {"scratch": torch.empty(100, dtype=torch.uint8)}, "smaller than one expert"),
    ):
        with pytest.raises(ValueError, match=pattern):
            retile_(bad, CODE_CHUNK_BYTES, tiled=True, **kwargs)
    assert torch.equal(codes, before)


@pytest.mark.parametrize("block_k", [128, 256])
def test_triton_gemm_reads_tiled_weights_to_the_same_bits(block_k):
    """grouped_w4a4 on tile_weights' layout: the same output bits as on row-major weights, for K tiles of one
    chunk and of two (BK = 256 spans two 1 KB blocks of a row group)."""
    from quads_megatron.kernels.tile_configs import TritonGemmConfig

    e, n, k, tokens, topk = 4, 64, 512, 6, 2
    g = torch.Generator().manual_seed(3)
    w = gemm_triton.stack_expert_weights([nvfp4.quantize(torch.randn(n, k, generator=g) * 0.02) for _ in range(e)])
    tiled = (*tile_weights(w[0], w[1]), w[2])
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)])
    order, offs, _ = route(ids, e)
    op = act_quant.activation_operand(torch.randn(tokens, k, generator=g).bfloat16())
    cfg = TritonGemmConfig(block_m=16, block_n=32, block_k=block_k, num_warps=4, num_stages=1)
    tok = (order // topk).to(torch.int32)
    want = gemm_triton.grouped_w4a4(op, offs, *w, a_rows=tok, config=cfg)
    assert torch.equal(gemm_triton.grouped_w4a4(op, offs, *tiled, a_rows=tok, config=cfg), want)


def _experts(e: int, h: int, i: int):
    from quads_megatron.rollout.moe_block import ExpertWeights

    g = torch.Generator().manual_seed(5)
    w13, w2 = [], []
    for _ in range(e):
        gate, up = torch.randn(i, h, generator=g) * 0.05, torch.randn(i, h, generator=g) * 0.1
        w13.append(nvfp4.quantize(torch.cat([gate, up]), global_amax=nvfp4.shared_amax(gate, up)))
        w2.append(nvfp4.quantize(torch.randn(h, i, generator=g) * 0.05))
    return ExpertWeights(*gemm_triton.stack_expert_weights(w13), *gemm_triton.stack_expert_weights(w2))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("dynamic_channels", [0, 64])
def test_the_moe_block_on_tiled_weights_is_the_same_bits(impl, dynamic_channels):
    """moe_w4a4 on ExpertWeights.as_tiled(): the same output bits as on the row-major weights, through the
    kernel path and the reference one (which reads each expert back row-major), with and without RAC."""
    from quads_megatron.rollout.moe_block import GemmRAC, LayerRAC, moe_w4a4

    e, h, i, t, k = 4, 256, 128, 9, 2
    rows = _experts(e, h, i)
    tiled = rows.as_tiled()
    assert tiled.tiled and not rows.tiled and (tiled.hidden, tiled.intermediate) == (h, i)
    assert tiled.as_tiled() is tiled and rows.as_row_major() is rows
    back = tiled.as_row_major()
    assert (
        not back.tiled and torch.equal(back.w13_codes, rows.w13_codes) and torch.equal(back.w2_scales, rows.w2_scales)
    )
    g = torch.Generator().manual_seed(6)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    tw = torch.softmax(torch.randn(t, k, generator=g), -1)
    rac = LayerRAC(GemmRAC(dynamic_channels=dynamic_channels), GemmRAC(dynamic_channels=dynamic_channels // 2))
    want = moe_w4a4(x, ids, tw, rows, rac, impl=impl)
    assert torch.equal(moe_w4a4(x, ids, tw, tiled, rac, impl=impl), want)
    one = tiled.expert(2, "w2")
    assert torch.equal(one.codes, rows.expert(2, "w2").codes) and one.codes.shape == (h, i // 2)


def test_expert_weights_refuse_mixed_layouts():
    from quads_megatron.rollout.moe_block import ExpertWeights

    rows = _experts(2, 256, 128)
    tiled = rows.as_tiled()
    with pytest.raises(ValueError, match="same layout"):
        ExpertWeights(tiled.w13_codes, tiled.w13_scales, rows.w13_sdec, rows.w2_codes, rows.w2_scales, rows.w2_sdec)
    with pytest.raises(ValueError, match="expert weights: tiled weights must be"):
        ExpertWeights(
            tiled.w13_codes, tiled.w13_scales[..., :4], rows.w13_sdec, tiled.w2_codes, tiled.w2_scales, rows.w2_sdec
        )
