"""The fused pieces of the Triton MoE block against their unfused torch spelling (TRITON_INTERPRET=1 on CPU):
token-indexed fc1 operand rows, SiLU*up fused into fc2's activation quantization, the top-k combine
kernel, and the on-device tile schedule."""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.kernels import act_quant, gemm_triton, row_tiles
from quads_megatron.kernels import combine as combine_kernel
from quads_megatron.kernels.tile_configs import ActQuantConfig, TritonGemmConfig
from quads_megatron.nvfp4 import NVFP4InputError
from quads_megatron.rollout import rac_plan, reference
from quads_megatron.rollout.moe_block import combine, gated_activation, route

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
    plan = rac_plan.RACPlan(torch.tensor([1, 2]), K) if rac == "plan" else None
    wc, wsc, wsd = gemm_triton.stack_expert_weights(ws)
    op = act_quant.activation_operand(x, plan)
    gathered = act_quant.ActivationOperand(op.values[tokens], op.global_decode[tokens])
    cfg = dict(config=TritonGemmConfig(block_m=16, block_n=32, block_k=64))
    want = gemm_triton.grouped_w4a4(gathered, offs, wc, wsc, wsd, **cfg)
    got = gemm_triton.grouped_w4a4(op, offs, wc, wsc, wsd, a_rows=tokens, **cfg)
    n = int(offs[-1])  # rows of local experts (the foreign slot's row after them is not computed)
    assert got.shape == (T * TOPK, N) and n == T * TOPK - 1 and torch.equal(got[:n], want[:n])
    qa = act_quant.quantize_activation(x, plan)  # the codes path takes the same index
    qg = rac_plan.QuantizedActivation(
        nvfp4.NVFP4Tensor(qa.x.codes[tokens], qa.x.block_scales[tokens], qa.x.global_decode[tokens]),
        None
        if qa.residual is None
        else nvfp4.NVFP4Tensor(
            qa.residual.codes[tokens], qa.residual.block_scales[tokens], qa.residual.global_decode[tokens]
        ),
    )
    mask = None if plan is None else plan.block_mask("cpu")
    assert torch.equal(
        gemm_triton.grouped_w4a4(qa, offs, wc, wsc, wsd, mask, a_rows=tokens, **cfg)[:n],
        gemm_triton.grouped_w4a4(qg, offs, wc, wsc, wsd, mask, **cfg)[:n],
    )
    with pytest.raises(ValueError, match="a_rows"):
        gemm_triton.grouped_w4a4(op, offs, wc, wsc, wsd, a_rows=tokens.float(), **cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rac", ["none", "plan", "dynamic"])
def test_gated_operand_equals_quantizing_the_gated_activation(dtype, rac):
    g = torch.Generator().manual_seed(3)
    m, i = 37, 48
    y1 = (torch.randn(m, 2 * i, generator=g) * 3).to(dtype)
    valid = torch.rand(m, generator=g) > 0.2
    h = torch.where(valid[:, None], gated_activation(y1), 0.0)
    kw = {"none": {}, "plan": {"plan": rac_plan.RACPlan(torch.tensor([0, 2]), i)}, "dynamic": {"dynamic_channels": 16}}
    want = act_quant.activation_operand(h, **kw[rac])
    got = act_quant.activation_operand(y1, gated=True, row_valid=valid, **kw[rac])
    assert got.values.shape == (m, 2, i // 2)
    assert torch.equal(got.global_decode, want.global_decode)
    assert torch.equal(got.values, want.values)
    assert torch.equal(got.values[~valid], torch.zeros_like(got.values[~valid]))
    with pytest.raises(ValueError, match="gated"):
        act_quant.activation_operand(y1.float(), gated=True)
    with pytest.raises(ValueError, match="row_valid"):
        act_quant.activation_operand(y1, gated=True, row_valid=valid[:-1])
    # rows row_valid drops are never read: NaN there (e.g. a GEMM's unwritten padding rows) is no error,
    # in a kept row it is, and nothing is computed
    dropped, kept = int((~valid).nonzero()[0]), int(valid.nonzero()[0])
    y_nan = y1.clone()
    y_nan[dropped, 5] = float("nan")
    assert torch.equal(act_quant.activation_operand(y_nan, gated=True, row_valid=valid, **kw[rac]).values, got.values)
    y_nan[kept, 5] = float("nan")
    with pytest.raises(NVFP4InputError, match="NaN"):
        act_quant.activation_operand(y_nan, gated=True, row_valid=valid, **kw[rac])


@pytest.mark.parametrize("k,order", [(48, "pairs"), (384, "wgmma"), (768, "wgmma")])
@pytest.mark.parametrize("rac", ["none", "plan", "dynamic", "4over6", "dynamic_4over6"])
def test_a_row_in_two_pieces_gives_the_bits_of_one_padded_tile(monkeypatch, k, order, rac):
    """A whole row of K = P + a smaller power of two (768 = 512 + 256, fc2's input here) held as two unpadded
    pieces (a tile's split_row, or QUADS_ACT_SPLIT_ROW=1; by default only where no residual is written) gives the
    bits of the one tile padded to 2P (=0): the operand (gated and not, both orders) and the codes path, with a
    static RAC plan, with dynamic RAC (both pieces' blocks ranked together: rows whose second piece repeats
    the first's values tie across the pieces, an all-zero row ties everywhere) and under 4over6 (with and without
    dynamic RAC)."""
    g = torch.Generator().manual_seed(k)
    m = 9
    y1 = (torch.randn(m, 2 * k, generator=g) * 3).bfloat16()
    x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(k, generator=g))).bfloat16()
    p = 1 << (k.bit_length() - 1)
    rest = k - p
    x[1, p:] = x[1, :rest]  # the same blocks in both pieces: equal scores across them
    y1[2, p:k] = y1[2, :rest]
    y1[2, k + p :] = y1[2, k : k + rest]
    x[3] = 0.0
    plan = rac_plan.RACPlan(torch.tensor([0, 2]), k) if rac == "plan" else None
    kw = {
        "none": {},
        "plan": {"plan": plan},
        "dynamic": {"dynamic_channels": 16 * (k // 32)},
        "4over6": {"recipe": nvfp4.NVFP4Recipe(True, 256, "MSE")},
        "dynamic_4over6": {"dynamic_channels": 16 * (k // 32), "recipe": nvfp4.NVFP4Recipe(True, 448, "MAE")},
    }[rac]
    monkeypatch.delenv("QUADS_ACT_SPLIT_ROW", raising=False)  # by default: where no residual is written
    assert act_quant.row_split(k, 2 * p, order) == p and act_quant.row_split(k, p, order) == 0
    assert act_quant.row_split(k, 2 * p, order, residual=True) == 0
    assert act_quant.row_split(k, 2 * p, order, residual=True, want=True) == p  # a tile's split_row
    assert act_quant.row_split(k, 2 * p, order, want=False) == 0
    monkeypatch.setenv("QUADS_ACT_SPLIT_ROW", "yes")
    with pytest.raises(ValueError, match="QUADS_ACT_SPLIT_ROW must be 0, 1 or unset"):
        act_quant.row_split(k, 2 * p, order)
    monkeypatch.setenv("QUADS_ACT_SPLIT_ROW", "0")  # overrides a tile's split_row (A/B)
    assert act_quant.row_split(k, 2 * p, order, want=True) == 0

    def run(config=None):
        return (
            act_quant.activation_operand(y1, gated=True, order=order, config=config, **kw),
            act_quant.activation_operand(x, order=order, config=config, **kw),
            act_quant.quantize_activation(x, config=config, **kw),
        )

    one = run()
    monkeypatch.setenv("QUADS_ACT_SPLIT_ROW", "1")  # wherever it can: with a residual too
    assert act_quant.row_split(k, 2 * p, order, residual=True, want=False) == p
    two = run()
    monkeypatch.delenv("QUADS_ACT_SPLIT_ROW")
    three = run(ActQuantConfig(split_row=True))
    for other in (two, three):
        for a, b in zip(one[:2], other[:2], strict=True):
            assert torch.equal(a.values, b.values) and torch.equal(a.global_decode, b.global_decode)
        qa, qb = one[2], other[2]
        assert (qa.residual is None) == (qb.residual is None) == (rac in ("none", "4over6"))
        for a, b in [(qa.x, qb.x)] + ([(qa.residual, qb.residual)] if qa.residual is not None else []):
            assert torch.equal(a.codes, b.codes) and torch.equal(
                a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8)
            )
            assert torch.equal(a.global_decode, b.global_decode)
    if rac == "dynamic":  # the reference's selection, not one ranked per piece
        want = reference.quantize_activation(x.float(), dynamic_channels=16 * (k // 32))
        for a, b in [(one[2].x, want.x), (one[2].residual, want.residual)]:
            assert torch.equal(a.codes, b.codes)
            assert torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_combine_kernel_equals_the_torch_combine(dtype):
    g, _, ids, _ = _setup(4)
    order, _, valid = route(ids, E)
    y = (torch.randn(T * TOPK, 40, generator=g) * 4).bfloat16()
    tw = torch.softmax(torch.randn(T, TOPK, generator=g), -1)
    want = combine(y, order, valid, tw).to(dtype)
    got = combine_kernel.combine(y, order, ids, tw, E, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(got[2], (tw[2, [0, 2], None] * y[order.argsort()][[6, 8]].float()).sum(0).to(dtype))
    with pytest.raises(ValueError, match="combine"):
        combine_kernel.combine(y[:-1], order, ids, tw, E, dtype)


def _tile_map_reference(offs: list[int], bm: int, tiles: int) -> list[list[int]]:
    """(expert, first grouped row, expert's row end, total tiles) per row tile, by walking the experts."""
    out, begin = [], 0
    for e, end in enumerate(offs):
        out += [[e, r, end] for r in range(begin, end, bm)]
        begin = end
    total = len(out)
    return [(out[p] if p < total else [-1, 0, 0]) + [total] for p in range(tiles)]


@pytest.mark.parametrize("bm", [16, 64])
def test_tile_map(bm):
    """Each row tile's expert, first row and row end (empty experts skipped, -1 past the last tile), also
    across several programs of the map kernel (128 tiles each) and for an empty batch."""
    offs = torch.tensor([0, 3, 3, 40, 41], dtype=torch.int32)
    got = row_tiles.tile_map(offs, 16, 9).tolist()
    assert got == _tile_map_reference(offs.tolist(), 16, 9)
    assert [t[0] for t in got] == [1, 3, 3, 3, 4, -1, -1, -1, -1] and got[2][1:] == [19, 40, 5]
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 3 * bm, (40,), generator=g)
    counts[::7] = 0
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tiles = int(offs[-1]) // bm + 40
    assert row_tiles.tile_map(offs, bm, tiles).tolist() == _tile_map_reference(offs.tolist(), bm, tiles)
    assert row_tiles.tile_map(torch.zeros(4, dtype=torch.int32), bm, 4).tolist() == [[-1, 0, 0, 0]] * 4


@pytest.mark.parametrize("gated", [False, True])
def test_row_tiles_written_by_the_activation_launch(gated):
    """activation_operand(row_tiles=...) writes the GEMM's tile table from extra programs of its own launch
    (32 tiles each): the table equals tile_map's, and the operand is unchanged bit for bit."""
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 5, (70,), generator=g)
    counts[::4] = 0
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = int(offs[-1])
    x = (torch.randn(rows, 2 * K if gated else K, generator=g) * 3).bfloat16()
    plain = act_quant.activation_operand(x, gated=gated, config=ActQuantConfig(block_m=16))
    op = act_quant.activation_operand(x, gated=gated, config=ActQuantConfig(block_m=16), row_tiles=(offs, 16, rows))
    assert plain.tiles is None and op.tiles.block_rows == 16
    assert torch.equal(op.values, plain.values) and torch.equal(op.global_decode, plain.global_decode)
    want = row_tiles.RowTiles.count(rows, 16, offs.numel())
    assert op.tiles.table.shape == (want, 4) and want > 2 * 32  # several tile-map programs
    assert op.tiles.table.tolist() == _tile_map_reference(offs.tolist(), 16, want)


def test_grouped_gemm_takes_row_tiles_made_beforehand():
    """The GEMM with a shared tile table (as moe_w4a4's fc1 and fc2) equals the GEMM making its own; a
    table made for other tiles or another row count is refused before anything runs."""
    g, x, ids, ws = _setup(2)
    order, offs, _ = route(ids, E)
    tokens = order // TOPK
    wc, wsc, wsd = gemm_triton.stack_expert_weights(ws)
    op = act_quant.activation_operand(x, row_tiles=(offs, 16, tokens.numel()))
    tiles16, tiles32 = TritonGemmConfig(block_m=16, block_k=64), TritonGemmConfig(block_m=32, block_k=64)
    own = gemm_triton.grouped_w4a4(op, offs, wc, wsc, wsd, config=tiles16, a_rows=tokens)
    shared = gemm_triton.grouped_w4a4(op, offs, wc, wsc, wsd, config=tiles16, a_rows=tokens, tiles=op.tiles)
    done = int(offs[-1])  # rows past the last expert (the foreign slot) are not written
    assert torch.equal(own[:done], shared[:done])
    with pytest.raises(ValueError, match="row tiles of 16 rows"):
        gemm_triton.grouped_w4a4(op, offs, wc, wsc, wsd, config=tiles32, a_rows=tokens, tiles=op.tiles)
    with pytest.raises(ValueError, match="row tiles of 16 rows"):
        gemm_triton.grouped_w4a4(op, offs, wc, wsc, wsd, config=tiles16, a_rows=tokens[:-5], tiles=op.tiles)


@pytest.mark.parametrize(
    "t,k,e", [(1, 1, 1), (13, 3, 5), (16, 8, 128), (7, 4, 100), (300, 8, 96), (33, 6, 7), (40, 8, 512), (1024, 8, 128)]
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
def test_route_kernel_equals_the_torch_routing(t, k, e, dtype):
    from quads_megatron.kernels import route as route_kernel

    g = torch.Generator().manual_seed(t * 1000 + k * 10 + e)
    ids = torch.randint(-2, e + 3, (t, k), generator=g).to(dtype)  # foreign ids on both sides of [0, e)
    r = route_kernel.route(ids, e)
    order, offs, valid = route(ids, e)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel())
    assert torch.equal(r.order, order) and torch.equal(r.offs, offs) and torch.equal(r.valid, valid)
    assert torch.equal(r.tokens, order // k) and torch.equal(r.pos, pos)


@pytest.mark.parametrize(
    "t,k,e,chunk", [(1, 1, 1, 16), (13, 3, 5, 16), (300, 8, 96, 64), (40, 8, 512, 16), (2100, 8, 128, None)]
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_chunked_routing_equals_the_torch_routing(t, k, e, chunk, dtype):
    """route_chunked over one chunk or many (the last one partial; keys spread over chunks): the torch
    routing's order, offs, valid, each row's token and order's inverse, bit for bit."""
    from quads_megatron.kernels.route_chunked import route_chunked

    g = torch.Generator().manual_seed(t * 1000 + k * 10 + e)
    ids = torch.randint(-2, e + 3, (t, k), generator=g).to(dtype)  # foreign ids on both sides of [0, e)
    r = route_chunked(ids, e, chunk)
    order, offs, valid = route(ids, e)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel())
    assert torch.equal(r.order, order) and torch.equal(r.offs, offs) and torch.equal(r.valid, valid)
    assert torch.equal(r.tokens, order // k) and torch.equal(r.pos, pos)


def test_activation_quantization_compiles_for_sm90_lean():
    """fc2's gated operand kernel compiled for sm_90 (Triton's ptxas, a fresh process), one row per program,
    holds what its instruction counts rest on (docs/kernel-notes.md, v35): no spills; dynamic RAC on the row in
    two pieces takes fewer instructions and registers than on the padded tile (48 x 48 ranks, not 64 x 64) and
    at most 80 registers at one warp (25 CTAs an SM); each block's reciprocal scale is computed about once a
    block a thread (one warp: SiLU's 24 divisions + 2 global + 3 block + the slow path's, not 8 block copies);
    the block ranking costs the 4-warp tile under 112 instructions over a static plan's."""
    import json
    import os
    import subprocess
    import sys

    cases = [
        dict(k=768, warps=1, split_k=512),
        dict(k=768, warps=1, split_k=512, rac="dynamic"),
        dict(k=768, warps=1, split_k=0, rac="dynamic"),
        dict(k=768, warps=4, split_k=0, rac="dynamic"),
        dict(k=768, warps=4, split_k=0, rac="static"),
    ]
    out = subprocess.run(
        [sys.executable, "-m", "quads_megatron.kernels.sass_check", "--act-quant", json.dumps(cases)],
        capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    plain, two, one, dyn4, static4 = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(r["spills"] == 0 for r in (plain, two, one, dyn4, static4))
    assert two["instructions"] < one["instructions"] and two["regs"] < one["regs"] and two["regs"] <= 80, (two, one)
    assert plain["reciprocals"] <= 31, plain
    assert dyn4["instructions"] - static4["instructions"] < 112, (dyn4, static4)


def test_chunked_routing_compiles_for_sm90_without_spills():
    """Both launches of the chunked routing at the smallest, a middle and the largest chunk, compiled for sm_90
    (Triton's ptxas, a fresh process: the interpreter patches Triton's language in this one): the histogram
    lowers to shared-memory atomics, the sort and gather to warp shuffles, nothing spills to local memory."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "quads_megatron.kernels.sass_check", "--route-chunked", "256,1024,4096"],
        capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    reports = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(reports, key=int) == ["256", "1024", "4096"]
    for chunk, r in reports.items():
        assert r["counts"]["shared_atomics"] > 0 and r["place"]["shuffles"] > 0, (chunk, r)
        for name in ("counts", "place"):
            assert r[name]["spills"] == 0 and r[name]["regs"] < 255, (chunk, name, r[name])  # under the cap


def test_chunked_routing_of_nothing_and_bad_input():
    from quads_megatron.kernels.route_chunked import chunk_pairs, route_chunked

    r = route_chunked(torch.zeros(0, 8, dtype=torch.long), 4)
    assert r.offs.tolist() == [0] * 4 and r.order.numel() == 0 and r.pos.numel() == 0
    with pytest.raises(ValueError, match="integer"):
        route_chunked(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="power of two"):
        route_chunked(torch.zeros(2, 2, dtype=torch.long), 4, chunk=48)
    assert [chunk_pairs(n) for n in (1, 8192, 131072, 10**7)] == [256, 256, 1024, 4096]


@pytest.mark.parametrize("t,k,e,bm", [(16, 8, 128, 8), (5, 2, 4, 16), (40, 8, 16, 32), (3, 4, 8, 1), (300, 8, 96, 16)])
def test_route_kernel_writes_the_row_tiles(t, k, e, bm):
    """route(tile_rows=bm): each expert's program writes its own row tiles and the foreign program the empty
    ones past the last: the table tile_map makes from the routing's offs, entry for entry; the routing is
    the plain kernel's."""
    from quads_megatron.kernels import route as route_kernel

    g = torch.Generator().manual_seed(t + k + e + bm)
    ids = torch.randint(-1, e + 1, (t, k), generator=g)
    ids[:, 0] = 1  # one expert with several tiles
    plain, r = route_kernel.route(ids, e), route_kernel.route(ids, e, tile_rows=bm)
    assert plain.tiles is None and r.tiles.block_rows == bm and r.tiles.rows == ids.numel()
    for name in ("order", "offs", "valid", "tokens", "pos"):
        assert torch.equal(getattr(r, name), getattr(plain, name)), name
    p = row_tiles.RowTiles.count(ids.numel(), bm, e)
    assert r.tiles.table.tolist() == _tile_map_reference(r.offs.tolist(), bm, p)


@pytest.mark.parametrize("rac", [False, True])
def test_routing_in_the_activation_launch(rac):
    """activation_operand(route=(ids, E, rows)): E + 1 extra programs of fc1's quantization launch route the
    block and write its row tiles; operand, routing and tiles equal those of the separate launches."""
    from quads_megatron.kernels import route as route_kernel

    g = torch.Generator().manual_seed(3)
    e, t = 12, 9
    ids = torch.randint(0, e, (t, 4), generator=g)
    ids[2, 1] = -1  # a foreign slot
    x = (torch.randn(t, K, generator=g) * 3).bfloat16()
    dyn = 32 if rac else 0
    plain = act_quant.activation_operand(x, dynamic_channels=dyn)
    op = act_quant.activation_operand(x, dynamic_channels=dyn, route=(ids, e, 8))
    assert torch.equal(op.values, plain.values) and torch.equal(op.global_decode, plain.global_decode)
    want = route_kernel.route(ids, e, tile_rows=8)
    for name in ("order", "offs", "valid", "tokens", "pos"):
        assert torch.equal(getattr(op.routing, name), getattr(want, name)), name
    assert torch.equal(op.tiles.table, want.tiles.table) and op.tiles.block_rows == 8
    with pytest.raises(ValueError, match="not both"):
        act_quant.activation_operand(x, route=(ids, e, 8), row_tiles=(want.offs, 8, ids.numel()))
    with pytest.raises(ValueError, match=r"topk ids must be \[T=9, k\]"):
        act_quant.activation_operand(x, route=(ids[:-1], e, 8))


def test_route_kernel_refuses_what_it_cannot_route():
    from quads_megatron.kernels import route as route_kernel

    with pytest.raises(ValueError, match="integer"):
        route_kernel.route(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="ROUTE_MAX_ROWS"):
        route_kernel.route(torch.zeros(route_kernel.ROUTE_MAX_ROWS + 1, 1, dtype=torch.long), 4)
