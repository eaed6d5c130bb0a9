"""CUDA-only checks, run on the H200 by benchmarks/device_run.sh (skipped on CPU machines, where
test_megatron_patch / test_moe_w4a4 cover the same contracts through the CPU paths).

* the Megatron-Core patches on CUDA tensors (megatron-core 0.19 on the device): forward equals
  x @ qdq(W)^T, STE gradients, one QDQ per weight version, with the Triton QDQ twin;
* the rollout MoE block (the SGLang method's forward) at Qwen3-30B-A3B expert sizes: Triton path
  vs reference, strided S_dec views, and CUDA-graph capture (no host sync on the serving path);
* the block's fused pieces on the GPU: token-indexed fc1 rows, gated fc2 quantization (also with the row
  in two pieces, with dynamic RAC too), combine, the routing kernels (one launch, chunked);
* the Gluon Hopper GEMM (kernels/gemm_wgmma.py: the one-partition kernel and the warp-specialized one)
  against the Triton GEMM on every tile it may pick, and the whole block on it (moe_w4a4's default on
  an H200);
* the decode-size Gluon GEMM (kernels/gemm_mma.py) against the Triton GEMM on every tile it may pick,
  and the whole block on it.
"""

import dataclasses
import functools
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device script)")

H, INTER, E, TOPK = 2048, 768, 16, 8


@pytest.fixture(scope="module")
def megatron_world():
    from quads_megatron.demo.cpu_megatron import init_distributed

    init_distributed(backend="nccl")
    yield


def test_megatron_patches_on_cuda_tensors(megatron_world):
    import quads_megatron
    from quads_megatron import fake_quant, nvfp4
    from quads_megatron.demo.cpu_megatron import build_moe_layer, moe_config
    from quads_megatron.integrations.megatron import qat

    quads_megatron.remove()
    ref = build_moe_layer(moe_config(), seed=0).cuda()
    qat.leave_unquantized(ref)  # the reference holds qdq weights and runs unpatched
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if ".local_experts." in n:
                p.copy_(nvfp4.qdq(p))  # the torch contract
    quads_megatron.apply()
    try:
        layer = build_moe_layer(moe_config(), seed=0).cuda()
        fake_quant.reset_stats()
        x = torch.randn(6, 2, 32, device="cuda")
        outs = []
        for m in (layer, ref):
            xi = x.clone().requires_grad_(True)
            out, _ = m(xi)
            (out * torch.linspace(-1, 1, out.numel(), device="cuda").reshape(out.shape)).sum().backward()
            outs.append((out.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
        assert torch.equal(outs[0][0], outs[1][0])  # patched forward (Triton QDQ twin) == qdq weights
        assert torch.equal(outs[0][1], outs[1][1])
        for n, g in outs[0][2].items():
            assert torch.equal(g, outs[1][2][n]), n  # straight-through gradients
        calls = fake_quant.STATS.qdq_calls
        layer(x)  # a second micro-batch: cached QDQ
        assert fake_quant.STATS.qdq_calls == calls and fake_quant.STATS.cache_hits > 0
    finally:
        quads_megatron.remove()


@pytest.mark.parametrize("four_over_six", [False, True])
def test_batched_expert_qdq_is_the_per_expert_contract_on_cuda(four_over_six):
    """QAT's QDQ of a grouped linear's experts in one row-scaled Triton pass == the torch contract's
    per-tensor QDQ of each expert (the trainer's fake-quant of TEGroupedMLP weights)."""
    from quads_megatron import fake_quant, nvfp4

    recipe = nvfp4.NVFP4Recipe(True, 256, "MAE") if four_over_six else nvfp4.NVFP4Recipe()
    g = torch.Generator(device="cuda").manual_seed(5)
    ws = [(torch.randn(256, 512, generator=g, device="cuda") * 10 ** (e / 4 - 2)).bfloat16() for e in range(12)]
    ws[3].zero_()
    spec = fake_quant.FakeQuantSpec(recipe=recipe)
    fake_quant.clear_cache()
    got = fake_quant.fake_quant_weights(ws, spec, cache=False)
    for e, w in enumerate(ws):
        assert torch.equal(got[e], nvfp4.qdq(w, recipe=recipe)), e


def moe_case(t, seed=0):
    from quads_megatron import nvfp4
    from quads_megatron.kernels import gemm_triton
    from quads_megatron.rollout.moe_block import ExpertWeights

    g = torch.Generator(device="cuda").manual_seed(seed)
    w13, w2 = [], []
    for _ in range(E):
        gu = torch.randn(2 * INTER, H, generator=g, device="cuda") * 0.02
        w13.append(nvfp4.quantize(gu))
        w2.append(nvfp4.quantize(torch.randn(H, INTER, generator=g, device="cuda") * 0.02))
    w = ExpertWeights(*gemm_triton.stack_expert_weights(w13), *gemm_triton.stack_expert_weights(w2))
    x = (
        torch.randn(t, H, generator=g, device="cuda") * torch.exp(torch.randn(H, generator=g, device="cuda"))
    ).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:TOPK] for _ in range(t)])
    tw = torch.softmax(torch.randn(t, TOPK, generator=g, device="cuda"), -1)
    return x, ids, tw, w


@pytest.mark.parametrize("impl", ["triton", "wgmma", "mma"])
@pytest.mark.parametrize("rac", ["plain", "static", "dynamic"])
def test_moe_block_triton_matches_reference_on_gpu(rac, impl):
    from quads_megatron.rollout import rac_plan
    from quads_megatron.rollout.moe_block import ExpertWeights, GemmRAC, LayerRAC, moe_w4a4

    x, ids, tw, w = moe_case(48)
    ids[0, 0] = -1  # another EP rank's expert
    racs = {
        "plain": LayerRAC(),
        "static": LayerRAC(
            GemmRAC(rac_plan.RACPlan(torch.arange(0, 128, 2), H)),
            GemmRAC(rac_plan.RACPlan(torch.arange(0, 48, 2), INTER)),
        ),
        "dynamic": LayerRAC(GemmRAC(dynamic_channels=H // 2), GemmRAC(dynamic_channels=INTER // 2)),
    }
    r = racs[rac].on("cuda")
    ref = moe_w4a4(x, ids, tw, w, r, impl="reference").float()
    got = moe_w4a4(x, ids, tw, w, r, impl=impl).float()
    assert ((got - ref).norm() / ref.norm()).item() < 5e-3  # 1-ulp bf16 differences after fc1 only
    # the serving engine's S_dec is the gate column of an [E, 2] tensor: read through the stride
    s13 = torch.stack([w.w13_sdec, w.w13_sdec], 1)
    strided = ExpertWeights(w.w13_codes, w.w13_scales, s13[:, 0], w.w2_codes, w.w2_scales, w.w2_sdec)
    assert torch.equal(moe_w4a4(x, ids, tw, strided, r, impl=impl).float(), got)


def test_moe_block_captures_in_a_cuda_graph():
    from quads_megatron.rollout.moe_block import GemmRAC, LayerRAC, moe_w4a4

    x, ids, tw, w = moe_case(16, seed=1)
    r = LayerRAC(GemmRAC(dynamic_channels=H // 2), GemmRAC(dynamic_channels=INTER // 2))
    eager = moe_w4a4(x, ids, tw, w, r, check=False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_w4a4(x, ids, tw, w, r, check=False)  # warm-up (Triton compiles outside the capture)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_w4a4(x, ids, tw, w, r, check=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x2, ids2, tw2, _ = moe_case(16, seed=2)
    x.copy_(x2), ids.copy_(ids2), tw.copy_(tw2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_w4a4(x2, ids2, tw2, w, r, check=False))


@pytest.mark.parametrize("impl", ["triton", "wgmma", "mma"])
@pytest.mark.parametrize("tokens", [16, 300])
def test_programmatic_dependent_launch_changes_no_bit(monkeypatch, impl, tokens):
    """The block with its kernels launched programmatically dependent (kernels/pdl.py: each waits for the
    previous one's writes before its first read) equals the block launched plainly, eagerly and replayed
    from a CUDA graph (programmatic edges), at sizes running both GEMMs' kernels (300 tokens: 2400 rows,
    the warp-specialized Gluon kernel)."""
    from quads_megatron.kernels import pdl
    from quads_megatron.rollout.moe_block import GemmRAC, LayerRAC, moe_w4a4

    x, ids, tw, w = moe_case(tokens, seed=3)
    r = LayerRAC(GemmRAC(dynamic_channels=H // 2), GemmRAC(dynamic_channels=INTER // 2))
    monkeypatch.setenv("QUADS_PDL", "0")
    assert not pdl.enabled(x.device)
    plain = moe_w4a4(x, ids, tw, w, r, check=False, impl=impl)
    monkeypatch.setenv("QUADS_PDL", "1")
    assert pdl.enabled(x.device)
    assert torch.equal(moe_w4a4(x, ids, tw, w, r, check=False, impl=impl), plain)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_w4a4(x, ids, tw, w, r, check=False, impl=impl)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_w4a4(x, ids, tw, w, r, check=False, impl=impl)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)


def test_fused_block_pieces_on_gpu():
    """Token-indexed fc1 rows (bit for bit), SiLU*up fused into fc2's quantization (GPU exp is Triton's
    own, so a few h values may round differently than torch's silu), the combine kernel."""
    from quads_megatron.kernels import act_quant, gemm_triton, tile_configs
    from quads_megatron.kernels import combine as combine_kernel
    from quads_megatron.rollout.moe_block import combine, gated_activation, route

    x, ids, tw, w = moe_case(200)
    ids[3, 1] = -1
    order, offs, valid = route(ids, E)
    tok = order // TOPK
    op = act_quant.activation_operand(x)
    n = int(offs[-1])
    gathered = act_quant.ActivationOperand(op.values[tok], op.global_decode[tok])
    for rows in (16, 8192, 65536):  # the tuned tiles of each row bucket
        cfg = tile_configs.triton_gemm_config(rows, H, "cuda")
        want = gemm_triton.grouped_w4a4(gathered, offs, *_w13(w), config=cfg)
        assert torch.equal(gemm_triton.grouped_w4a4(op, offs, *_w13(w), a_rows=tok, config=cfg)[:n], want[:n])
    y1 = gemm_triton.grouped_w4a4(op, offs, *_w13(w), a_rows=tok, config=tile_configs.triton_gemm_config(16, H, "cuda"))
    fused = act_quant.activation_operand(y1, gated=True, row_valid=valid)
    unfused = act_quant.activation_operand(torch.where(valid[:, None], gated_activation(y1), 0.0))
    same = (fused.values == unfused.values).float().mean().item()
    assert same > 0.99 and torch.allclose(fused.global_decode, unfused.global_decode, rtol=1e-2)
    y2 = torch.randn(ids.numel(), H, device="cuda").bfloat16()
    got = combine_kernel.combine(y2, order, ids, tw, E, torch.float32)
    assert torch.allclose(got, combine(y2, order, valid, tw), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("order", ["pairs", "wgmma"])
def test_a_row_in_two_pieces_on_gpu(monkeypatch, order):
    """A row in two pieces (fc2's K = 768 held as 512 + 256 in registers, no padded lanes: a tile's split_row, or
    QUADS_ACT_SPLIT_ROW=1) gives the padded tile's bits on the GPU: the gated operand at the block's row counts,
    plain, with a static RAC plan and with dynamic RAC (both pieces' blocks ranked together), at 1, 2 and 4
    warps; the dynamic RAC codes of the two pieces equal the reference's."""
    from quads_megatron.kernels import act_quant
    from quads_megatron.kernels.tile_configs import ActQuantConfig
    from quads_megatron.rollout import rac_plan, reference
    from quads_megatron.rollout.moe_block import gated_activation

    monkeypatch.delenv("QUADS_ACT_SPLIT_ROW", raising=False)
    g = torch.Generator(device="cuda").manual_seed(5)
    plan = rac_plan.RACPlan(torch.arange(0, INTER // 16, 2), INTER)
    for rows in (128, 2048, 8192):
        y1 = (torch.randn(rows, 2 * INTER, generator=g, device="cuda") * 3).bfloat16()
        valid = torch.rand(rows, generator=g, device="cuda") > 0.1
        for kw in ({}, {"plan": plan}, {"dynamic_channels": INTER // 2}):
            one = act_quant.activation_operand(
                y1, gated=True, row_valid=valid, order=order, config=ActQuantConfig(split_row=False), **kw
            )
            for warps in (1, 2, 4):
                tile = ActQuantConfig(num_warps=warps, split_row=True)
                two = act_quant.activation_operand(y1, gated=True, row_valid=valid, order=order, config=tile, **kw)
                assert torch.equal(one.values, two.values), (rows, kw.keys(), warps)
                assert torch.equal(one.global_decode, two.global_decode), (rows, kw.keys(), warps)
            monkeypatch.setenv("QUADS_ACT_SPLIT_ROW", "1")
            env = act_quant.activation_operand(y1, gated=True, row_valid=valid, order=order, **kw)
            monkeypatch.delenv("QUADS_ACT_SPLIT_ROW")
            assert torch.equal(one.values, env.values), (rows, kw.keys())
    h = gated_activation(y1[:256])
    tile = ActQuantConfig(num_warps=1, split_row=True)
    got = act_quant.quantize_activation(h, config=tile, dynamic_channels=INTER // 2)
    want = reference.quantize_activation(h.cpu().float(), dynamic_channels=INTER // 2)
    for a, b in [(got.x, want.x), (got.residual, want.residual)]:
        assert torch.equal(a.codes.cpu(), b.codes)
        assert torch.equal(a.block_scales.view(torch.uint8).cpu(), b.block_scales.view(torch.uint8))
        assert torch.equal(a.global_decode.cpu(), b.global_decode)


@pytest.mark.parametrize(
    "tokens,experts,bm", [(16, 128, 8), (64, 128, 8), (256, 128, 16), (1024, 128, 16), (7, 16, 32)]
)
def test_routing_with_row_tiles_on_gpu(tokens, experts, bm):
    """The routing kernel on the GPU's histogram (the CPU tests run its one-hot twin): with tile_rows its table
    is tile_map's; inside fc1's quantization launch routing, tiles and operand equal the separate launches'."""
    from quads_megatron.kernels import act_quant
    from quads_megatron.kernels import route as route_kernel
    from quads_megatron.kernels.row_tiles import RowTiles, tile_map
    from quads_megatron.rollout.moe_block import route

    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.randint(-1, experts, (tokens, TOPK), generator=g, device="cuda")
    order, offs, valid = route(ids, experts)
    r = route_kernel.route(ids, experts, tile_rows=bm)
    assert torch.equal(r.order, order) and torch.equal(r.offs, offs) and torch.equal(r.valid, valid)
    assert torch.equal(r.tiles.table, tile_map(r.offs, bm, RowTiles.count(ids.numel(), bm, experts)))
    x = torch.randn(tokens, H, generator=g, device="cuda").bfloat16()
    op = act_quant.activation_operand(x, route=(ids, experts, bm))
    plain = act_quant.activation_operand(x)
    assert torch.equal(op.values, plain.values) and torch.equal(op.global_decode, plain.global_decode)
    assert torch.equal(op.tiles.table, r.tiles.table)
    for name in ("order", "offs", "valid", "tokens", "pos"):
        assert torch.equal(getattr(op.routing, name), getattr(r, name)), name


@pytest.mark.parametrize("tokens,experts,chunk", [(1024, 128, None), (4096, 128, None), (16384, 128, None),
                                                  (16384, 256, 4096), (3000, 128, 256), (5, 16, None)])  # fmt: skip
def test_chunked_routing_on_gpu(tokens, experts, chunk):
    """The chunked routing on the GPU's histogram and sort: the torch routing and order's inverse, bit for
    bit, at prefill sizes (many chunks, the last one partial, foreign slots)."""
    from quads_megatron.kernels.route_chunked import route_chunked
    from quads_megatron.rollout.moe_block import route

    g = torch.Generator(device="cuda").manual_seed(tokens + experts)
    ids = torch.randint(-1, experts + 1, (tokens, TOPK), generator=g, device="cuda")
    order, offs, valid = route(ids, experts)
    r = route_chunked(ids, experts, chunk)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device="cuda")
    assert torch.equal(r.order, order) and torch.equal(r.offs, offs) and torch.equal(r.valid, valid)
    assert torch.equal(r.tokens, order // TOPK) and torch.equal(r.pos, pos)


@pytest.mark.parametrize("tokens", [1024, 4096])
def test_block_on_the_chunked_routing_on_gpu(monkeypatch, tokens):
    """moe_w4a4(impl='auto') on the chunked routing and on the torch routing: the same bits."""
    from quads_megatron.rollout.moe_block import moe_w4a4

    x, ids, tw, weights = moe_case(tokens)
    ids[::5, 1] = -1  # slots of another EP rank
    monkeypatch.setenv("QUADS_ROUTING", "torch")
    want = moe_w4a4(x, ids, tw, weights, check=False)
    monkeypatch.setenv("QUADS_ROUTING", "chunked")
    assert torch.equal(moe_w4a4(x, ids, tw, weights, check=False), want)


def _w13(w):
    return w.w13_codes, w.w13_scales, w.w13_sdec


@pytest.mark.parametrize("layer", ["fc1", "fc2"])
def test_wgmma_gemm_matches_the_triton_gemm(layer):
    """Same exact products, fp32 sums in another order: equal to ~1e-7 relative, on every tile
    (row tails, an expert without rows, token-indexed and plain rows); on weight_layout's tiled weights the
    same bits as on row-major ones (tuned tiles, TMA stores, three consumer warpgroups)."""
    from quads_megatron import nvfp4
    from quads_megatron.kernels import act_quant, gemm_triton, tile_configs, weight_layout
    from quads_megatron.kernels import gemm_wgmma_launch as wg
    from quads_megatron.kernels.tile_configs import TritonGemmConfig, WgmmaConfig
    from quads_megatron.rollout.moe_block import route

    n, k = (2 * INTER, H) if layer == "fc1" else (H, INTER)
    g = torch.Generator(device="cuda").manual_seed(7)
    w = gemm_triton.stack_expert_weights(
        [nvfp4.quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02) for _ in range(E)]
    )
    t = 301
    ids = torch.stack(
        [torch.randperm(E - 1, generator=g, device="cuda")[:TOPK] for _ in range(t)]
    )  # expert 15: no rows
    order, offs, _ = route(ids, E)
    tok = order // TOPK
    x = (
        torch.randn(t, k, generator=g, device="cuda") * torch.exp(torch.randn(k, generator=g, device="cuda"))
    ).bfloat16()
    pairs, perm = act_quant.activation_operand(x), act_quant.activation_operand(x, order="wgmma")
    rows = int(offs[-1])  # grouped rows of local experts
    gathered = act_quant.ActivationOperand(pairs.values[tok], pairs.global_decode[tok])
    for a_rows in (tok, None):  # token-indexed rows, or one operand row per grouped row
        a, s_dec = (
            (perm.values, perm.global_decode) if a_rows is not None else (perm.values[tok], perm.global_decode[tok])
        )
        want = gemm_triton.grouped_w4a4(
            pairs if a_rows is not None else gathered,
            offs,
            *w,
            out_dtype=torch.float32,
            config=TritonGemmConfig(block_m=16, block_n=64),
            a_rows=a_rows,
        )[:rows]
        for bt, nw, st, kc, un, regs, lw, cps, *flags in [
            (16, 4, 3, 1, 1, None, 0, 0),
            (16, 8, 2, 2, 1, None, 0, 0),
            (16, 8, 8, 1, 4, None, 0, 0),
            (16, 8, 4, 2, 4, 128, 0, 0),
            (32, 8, 3, 2, 1, None, 0, 0),
            (32, 8, 6, 1, 8, None, 0, 0),
            (64, 8, 4, 1, 1, None, 0, 0),
            (128, 8, 4, 1, 4, None, 0, 0),
            (16, 8, 3, 1, 1, 80, 4, 0),  # warp-specialized: loader warps fill an mbarrier ring
            (64, 8, 3, 1, 1, 80, 4, 0),
            (16, 8, 3, 2, 1, 80, 4, 0),  # ... two 128-K chunks per ring slot
            (64, 8, 2, 2, 1, 80, 4, 0),
            (32, 8, 2, 1, 1, 80, 2, 0),
            (64, 4, 3, 1, 1, None, 2, 0),
            (16, 8, 3, 1, 1, 80, 4, 2),  # ... with persistent CTAs: several tiles each, one ring across them
            (64, 8, 3, 1, 1, 80, 4, 2),
            (32, 8, 3, 2, 1, 80, 4, 2),
            (128, 8, 3, 1, 1, 168, 4, 1),
            (64, 8, 3, 2, 2, 128, 4, 1),  # ... a slot's first chunk in flight under the second one's decode
            (32, 8, 3, 2, 2, 96, 4, 0),
            (32, 8, 4, 1, 1, 80, 4, 0, True),  # ... each consumer warpgroup its own partition
            (64, 8, 3, 1, 1, 80, 4, 2, True),
            (64, 8, 3, 2, 2, 128, 4, 1, True),
            (16, 8, 3, 2, 1, None, 4, 0, True),
            (32, 8, 3, 2, 1, 80, 4, 0, True, True),  # ... rows past the expert zero-filled, not read
            (128, 8, 2, 2, 2, 168, 4, 1, True, True),
            (16, 8, 3, 1, 1, None, 0, 0, False, True),
            (32, 8, 3, 2, 1, 80, 4, 0, True, True, True),  # ... tiles with <= BT / 2 rows left: half-width wgmma
            (32, 8, 3, 2, 1, 80, 4, 2, True, False, True),
            (64, 8, 3, 1, 1, 80, 4, 0, False, True, True),
            (128, 8, 2, 2, 2, 168, 4, 1, True, True, True),
        ]:  # unroll: k-steps per straight-line run (each decode but the run's first overlaps a wgmma); unroll 1
            # with 2 stages: the ring refills the slot of the step just retired
            kw = dict(block_t=bt, num_warps=nw, stages=st, chunks=kc, unroll=un, maxnreg=regs, loader_warps=lw)
            split, mask_rows, narrow = (list(flags) + [False] * 3)[:3]
            kw = WgmmaConfig(**kw, ctas_per_sm=cps, split=split, mask_rows=mask_rows, narrow=narrow)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a register-hazard fallback would warn
                got = wg.grouped_w4a4_wgmma(a, s_dec, offs, *w, torch.float32, a_rows, config=kw)
            err = ((got[:rows] - want).norm() / want.norm()).item()
            assert err < 1e-6, (kw, err)
            assert torch.allclose(got[:rows], want, rtol=1e-4, atol=1e-5 * want.abs().max().item()), kw
    y_triton = gemm_triton.grouped_w4a4(pairs, offs, *w, a_rows=tok, config=TritonGemmConfig(block_m=16, block_n=64))
    y_triton = y_triton[:rows]
    tiled = (*weight_layout.tile_weights(w[0], w[1]), w[2])
    for big in (0, 8192, 32768, 131072):  # the tuned tiles at this size, and those of larger row buckets
        kw = tile_configs.wgmma_config(big, n, device="cuda", k=k) if big else None
        y = wg.grouped_w4a4_wgmma(perm.values, perm.global_decode, offs, *w, a_rows=tok, config=kw)[:rows]
        y_tiled = wg.grouped_w4a4_wgmma(perm.values, perm.global_decode, offs, *tiled, a_rows=tok, config=kw)
        assert torch.equal(y_tiled[:rows], y), (big, "tiled")
        assert y.dtype == torch.bfloat16
        assert torch.allclose(y.float(), y_triton.float(), rtol=1e-2, atol=1e-3 * y_triton.float().abs().max().item())
    # full tiles through a shared-memory buffer and a TMA bulk store, partial ones read back and masked; fc1's
    # 128-token tiles also on three consumer warpgroups (192 weight rows per CTA): the same bits
    for bt, st, kc, un, regs, cps in ((32, 3, 2, 1, 80, 0), (64, 3, 1, 1, 80, 2), (128, 2, 2, 2, 168, 1)):
        kw = dict(block_t=bt, num_warps=8, stages=st, chunks=kc, unroll=un, maxnreg=regs, loader_warps=4)
        kw.update(ctas_per_sm=cps, split=True, mask_rows=True, narrow=True)
        gemm = functools.partial(wg.grouped_w4a4_wgmma, perm.values, perm.global_decode, offs, *w, a_rows=tok)
        ys = [gemm(config=WgmmaConfig(**kw, tma_store=f)) for f in (False, True)]
        if bt == 128 and n % 192 == 0:
            ys += [gemm(config=WgmmaConfig(**{**kw, "num_warps": 12, "unroll": 1, "maxnreg": 128}, tma_store=False))]
            three = {**kw, "num_warps": 12, "stages": 3, "chunks": 1, "unroll": 1, "maxnreg": 128}
            ys += [gemm(config=WgmmaConfig(**three, tma_store=True))]
        assert len(ys) == (4 if bt == 128 and layer == "fc1" else 2)
        assert all(torch.equal(ys[0], y) for y in ys[1:]), kw
        on_tiles = functools.partial(wg.grouped_w4a4_wgmma, perm.values, perm.global_decode, offs, *tiled, a_rows=tok)
        assert torch.equal(on_tiles(config=WgmmaConfig(**kw, tma_store=True)), ys[0]), (kw, "tiled")
        if bt == 128 and n % 192 == 0:
            assert torch.equal(on_tiles(config=WgmmaConfig(**three, tma_store=True)), ys[0]), (three, "tiled")
        # the loader's L2 prefetches ahead (one chunk, four, past the row's end) change no bit, on either layout
        for l2 in (1, 4, 16):
            assert torch.equal(gemm(config=WgmmaConfig(**kw, l2_prefetch=l2)), ys[0]), (kw, l2)
            assert torch.equal(on_tiles(config=WgmmaConfig(**kw, l2_prefetch=l2)), ys[0]), (kw, l2, "tiled")


@pytest.mark.parametrize("layer", ["fc1", "fc2"])
def test_mma_gemm_matches_the_triton_gemm(layer):
    """Same exact products, fp32 sums in another order: equal to ~1e-7 relative on every tile (8, 16 and 32
    token rows; row tails past the tile, an expert without rows, experts with more rows than a tile,
    token-indexed and plain rows, bf16 and fp32 outputs), the same bits on tile_weights' layout, and the
    whole block on the tuned tiles at decode sizes."""
    from quads_megatron import nvfp4
    from quads_megatron.kernels import act_quant, gemm_triton, tile_configs, weight_layout
    from quads_megatron.kernels import gemm_mma_launch as mm
    from quads_megatron.kernels.tile_configs import MmaConfig, TritonGemmConfig
    from quads_megatron.rollout.moe_block import route

    n, k = (2 * INTER, H) if layer == "fc1" else (H, INTER)
    g = torch.Generator(device="cuda").manual_seed(8)
    w = gemm_triton.stack_expert_weights(
        [nvfp4.quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02) for _ in range(E)]
    )
    tiled = (*weight_layout.tile_weights(w[0], w[1]), w[2])  # the same weights, 16-row groups' chunks contiguous
    for t in (5, 37, 300):  # 0-3 rows per expert, up to ~10, and ~19 (up to ~35: several 32-row tiles)
        ids = torch.stack([torch.randperm(E - 1, generator=g, device="cuda")[:TOPK] for _ in range(t)])
        order, offs, _ = route(ids, E)
        tok = order // TOPK
        x = (
            torch.randn(t, k, generator=g, device="cuda") * torch.exp(torch.randn(k, generator=g, device="cuda"))
        ).bfloat16()
        pairs = act_quant.activation_operand(x)
        rows = int(offs[-1])
        gathered = act_quant.ActivationOperand(pairs.values[tok], pairs.global_decode[tok])
        for a_rows in (tok, None):
            op = pairs if a_rows is not None else gathered
            cfg = TritonGemmConfig(block_m=16, block_n=64)
            for dtype in (torch.float32, torch.bfloat16):
                want = gemm_triton.grouped_w4a4(op, offs, *w, out_dtype=dtype, config=cfg, a_rows=a_rows)[:rows]
                for bt, nw, rg, kc, pf in [(8, 4, 1, 1, 0), (8, 4, 1, 2, 0), (8, 4, 2, 2, 0), (8, 8, 1, 2, 0),
                                           (16, 4, 1, 1, 0), (16, 4, 2, 2, 0), (16, 8, 2, 1, 0), (8, 4, 2, 1, 1),
                                           (16, 8, 1, 1, 1), (8, 4, 1, 4, 2), (8, 4, 2, 8, 2),
                                           (16, 4, 1, 2, 2), (8, 4, 1, 3, 2), (32, 4, 1, 2, 0), (32, 8, 1, 1, 0),
                                           (32, 4, 1, 4, 2), (32, 4, 2, 1, 1), (32, 4, 2, 1, 0),
                                           (32, 4, 4, 1, 0)]:  # fmt: skip  (pf 2: weights_first)
                    kw = MmaConfig(block_t=bt, num_warps=nw, row_groups=rg, chunks=kc, prefetch=pf == 1,
                                   weights_first=pf == 2)  # fmt: skip
                    got = mm.grouped_w4a4_mma(op.values, op.global_decode, offs, *w, dtype, a_rows, config=kw)
                    assert got.dtype == dtype
                    got, ref = got[:rows].float(), want.float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    assert err < (1e-6 if dtype == torch.float32 else 5e-3), (kw, dtype, err)
                    if dtype == torch.float32:
                        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item()), kw
                    same = mm.grouped_w4a4_mma(op.values, op.global_decode, offs, *tiled, dtype, a_rows, config=kw)
                    assert torch.equal(same[:rows].float(), got), ("tiled", kw)
                # L2 prefetches ahead (one chunk, four, past the row's end; each K loop) and persistent CTAs (one,
                # or several tiles each) change no bit
                for kw in (MmaConfig(chunks=2, weights_first=True), MmaConfig(chunks=4), MmaConfig(prefetch=True)):
                    for wts in (w, tiled):
                        y0 = mm.grouped_w4a4_mma(op.values, op.global_decode, offs, *wts, dtype, a_rows, config=kw)
                        for change in (dict(l2_prefetch=1), dict(l2_prefetch=4), dict(l2_prefetch=16),
                                       dict(ctas_per_sm=1), dict(ctas_per_sm=8, l2_prefetch=4)):  # fmt: skip
                            kc = dataclasses.replace(kw, **change)
                            y = mm.grouped_w4a4_mma(op.values, op.global_decode, offs, *wts, dtype, a_rows, config=kc)
                            assert torch.equal(y, y0), (kc, dtype)
        for big in (0, 128, 1024, 8192):  # the tuned tiles of each row bucket
            kw = tile_configs.mma_config(big, k, "cuda") if big else None
            y = mm.grouped_w4a4_mma(pairs.values, pairs.global_decode, offs, *w, a_rows=tok, config=kw)[:rows]
            ref = gemm_triton.grouped_w4a4(pairs, offs, *w, a_rows=tok)[:rows].float()
            assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize("err_mode,e4m3_max", [("MAE", 256), ("MSE", 448)])
def test_four_over_six_kernels_on_cuda_equal_the_contract(err_mode, e4m3_max):
    """The 4over6 Triton kernels compiled for the GPU (fma off, div_rn) give the torch contract's bits:
    the quantize twin per tensor and per row, TE's golden vectors, and act_quant with dynamic RAC."""
    from quads_megatron import nvfp4
    from quads_megatron.kernels import act_quant, nvfp4_quant
    from quads_megatron.rollout import reference
    from test_te_golden import CASES, assert_same_as_te, golden

    recipe = nvfp4.NVFP4Recipe(True, e4m3_max, err_mode)
    cpu = lambda t: nvfp4.NVFP4Tensor(t.codes.cpu(), t.block_scales.cpu(), t.global_decode.cpu())  # noqa: E731
    g = torch.Generator(device="cuda").manual_seed(0)
    spread = torch.exp(torch.randn(H, generator=g, device="cuda"))
    w = torch.randn(2 * INTER, H, generator=g, device="cuda") * spread
    for mode in ("tensor", "row"):
        assert nvfp4.quantize(w.cpu(), mode, recipe=recipe).same_bits(cpu(nvfp4_quant.quantize(w, mode, recipe=recipe)))
    variant = f"fos_{err_mode.lower()}_{e4m3_max}"
    for case in CASES:
        x, data, scale, _, _ = golden(case, variant)
        q = nvfp4_quant.quantize(x.cuda(), recipe=recipe, block_k=64 if x.shape[-1] % 64 == 0 else 32)
        assert_same_as_te(cpu(q), data, scale, case)
    x = (torch.randn(64, H, generator=g, device="cuda") * spread).bfloat16()
    want = reference.quantize_activation(x.cpu(), dynamic_channels=256, recipe=recipe)
    got = act_quant.quantize_activation(x, dynamic_channels=256, recipe=recipe)
    assert want.x.same_bits(cpu(got.x)) and want.residual.same_bits(cpu(got.residual))
