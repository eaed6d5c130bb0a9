"""The decode-size Gluon GEMM (kernels/gemm_mma.py, gemm_mma_launch.py) on a CPU machine.

* its K order: the permutations that put the decoded weights into mma.sync's A fragments and the "pairs"
  activation operand into its B fragments meet every weight element with its own activation element;
* the kernel, compiled ahead of time for sm_90 with Triton's own ptxas (no GPU needed) at every tile the
  data file configs/mma_gemm.json holds and a few others: both layout conversions are asserted trivial at
  compile time, and the K loop reads global memory in 16-byte accesses straight into registers (no shared
  memory, no barriers), issues the MMAs the tile implies, spills nothing;
* the kernel compiled on the tiled weight layout (weight_layout; its bytes: test_weight_layout.py);
* the host side's checks (operand order, tile fit) and moe_block's choice of GEMM.
Its numbers are checked on the GPU (tests/test_gpu_cuda.py).
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from quads_megatron.errors import KernelConfigError
from quads_megatron.kernels import act_quant, tile_configs
from quads_megatron.kernels.tile_configs import MmaConfig

mm = pytest.importorskip("quads_megatron.kernels.gemm_mma_launch", reason="needs a Triton with Gluon")
from quads_megatron.kernels import gemm_mma, gluon_device  # noqa: E402  (after the Gluon check)


def test_weights_and_activations_meet_in_the_same_k_slot():
    """Physical k of each (mma, k slot) of a 128-chunk through the weight path (code byte b = 16t + 4w + q of
    a row, nibble s: k = 2b + s) and through the activation path (pair p, half s of the "pairs" operand: k =
    2p + s), permuted as the kernel does: the same k everywhere, each k once."""
    byte = torch.arange(64).reshape(8, 8)  # [scale block, byte]: the decode's [rows, 8, 8] code tile
    k_w = torch.stack([2 * byte, 2 * byte + 1], -1)  # join(lo, hi): nibble last
    k_w = k_w.reshape(1, 2, 2, 2, 2, 2, 2, 2).permute(*gluon_device.DECODE_PERM.value).reshape(128)
    pair = torch.arange(64)
    k_x = torch.stack([2 * pair, 2 * pair + 1])  # [2 (even | odd), 64 pairs]: one row of a pairs chunk
    k_x = k_x.reshape(1, 2, 2, 2, 2, 2, 2, 2).permute(*gemm_mma.X_PERM.value).reshape(128)
    assert torch.equal(k_w, k_x)
    assert torch.equal(k_w.sort().values, torch.arange(128))
    # slot (w1 w0 s q1 t1 t0 q0): lane 4g + t holds k slots 2t, 2t+1, 2t+8, 2t+9 of each of the 8 MMAs, and
    # those are its own 16 code bytes (two scale blocks): mma.sync's fragments need no data from other lanes
    for t in range(4):
        slots = [16 * m + 2 * t + d for m in range(8) for d in (0, 1, 8, 9)]
        assert set((k_w[slots] // 32).tolist()) == {t}


# (block_t, num_warps, row_groups, chunks, prefetch[, weight_loads[, weights_first[, l2_prefetch[, ctas_per_sm]]]])
EXTRA_TILES = [(8, 4, 1, 1, False), (8, 8, 2, 2, False), (16, 4, 1, 2, False), (16, 8, 1, 1, False), (8, 4, 2, 1, True),
               (16, 4, 1, 1, True), (8, 4, 1, 4, False), (8, 4, 1, 8, False), (8, 4, 4, 2, False),
               (8, 8, 2, 4, False, "cg"), (8, 4, 2, 2, False, "evict_first"), (8, 4, 1, 4, False, "default", True),
               (8, 4, 1, 8, False, "default", True), (16, 8, 1, 2, False, "default", True),
               (8, 4, 1, 3, False, "default", True), (32, 4, 1, 2, False, "evict_first"), (32, 8, 1, 1, False),
               (32, 4, 1, 4, False, "default", True), (32, 4, 2, 1, True), (32, 4, 2, 1, False, "evict_first"),
               (32, 4, 4, 1, False, "evict_first"), (8, 4, 1, 2, False, "default", True, 4),
               (8, 4, 1, 4, False, "evict_first", False, 8), (16, 4, 1, 1, True, "default", False, 2),
               (8, 8, 2, 2, False, "default", False, 16), (8, 4, 1, 2, False, "default", True, 0, 8),
               (16, 4, 1, 1, False, "evict_first", False, 0, 4),
               (8, 4, 1, 2, True, "default", False, 4, 2)]  # fmt: skip


def shipped_and_extra_tiles() -> list[MmaConfig]:
    table = tile_configs.load_table("mma_gemm")
    shipped = [MmaConfig(**r["tile"]) for entry in table["devices"].values() for r in entry["rules"]]
    return list(dict.fromkeys(shipped + [MmaConfig(*t) for t in EXTRA_TILES]))


def sm90_reports(tiles: list[MmaConfig], *flags: str) -> list[dict]:
    """sass_check's offline sm_90 reports of tiles (--mma and flags), compiled in a fresh process (the
    interpreter the other tests use patches Triton's language in this one)."""
    out = subprocess.run(
        [sys.executable, "-m", "quads_megatron.kernels.sass_check", "--mma", *flags,
         json.dumps([dataclasses.asdict(t) for t in tiles])],
        capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=1200,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("k", [2048, 768])
def test_kernel_compiles_for_sm90_streaming_registers_only(k):
    """Every shipped tile and the variants above at fc1's and fc2's K, compiled for sm_90 in a fresh process
    (the interpreter the other tests use patches Triton's language in this one)."""
    tiles = shipped_and_extra_tiles()
    reports = sm90_reports(tiles, "--k", str(k))
    assert len(reports) == len(tiles)
    for t, r in zip(tiles, reports, strict=True):
        assert r["chunks"] == mm.fit_tile(t, 16 * t.num_warps * t.row_groups, k)
        # 8 m16n8k16 per 128-K chunk, row group and 8 token rows (prefetch: one chunk per loop step)
        chunks = 1 if t.prefetch else r["chunks"]
        assert r["hmma_shape"] == ["16816"] and r["loop_hmma"] == 8 * chunks * t.row_groups * t.block_t // 8, r
        # code bytes and activations arrive by 16-byte loads (scale bytes by 2), straight into registers
        assert r["loop_shared"] == 0 and r["smem"] == 0, r
        want = {"default": ("LDG.E.128", "LDG.E.U16"), "cg": ("LDG.E.128.STRONG.GPU", "LDG.E.U16.STRONG.GPU"),
                "evict_first": ("LDG.E.EF.128", "LDG.E.EF.U16")}[t.weight_loads]  # the weights' cache hint
        assert set(r["loop_load_ops"]) == {"LDG.E.128", *want}, r  # activations: 16 bytes, no hint
        assert r["spills"] == 0, r
        # l2_prefetch: each chunk's code and scale bytes asked of L2 ahead, a row-major row per thread (two
        # prefetches, once more for every 32 * num_warps rows of the CTA's 16 * num_warps * row_groups)
        assert r["loop_l2_prefetch"] == (2 * -(-t.row_groups // 2) * chunks if t.l2_prefetch else 0), r
        # decode (11 per 8 weights), scale (1 per 2), loads, MMAs and the loop: under 3 instructions a weight
        # (the Triton and Gluon wgmma GEMMs: 3.6); 16 token rows take two MMAs per decoded weight fragment
        # (a register pipeline adds moves there), 32 rows four
        bound = {8: 2.8, 16: 3.2 if t.prefetch else 2.9, 32: 3.4}[t.block_t]
        # L2 prefetches: per chunk two, and (persistent CTAs) the choice of this tile's rows or the next one's
        bound += (0.7 if t.prefetch else 0.4) if t.l2_prefetch else 0.0
        assert r["per_weight"] < bound, r


def test_kernel_compiles_on_tiled_weights():
    """On tile_weights' layout the K loop keeps its 16-byte code loads, registers and spill-free code."""
    tiles = [MmaConfig(), MmaConfig(block_t=16, num_warps=4, chunks=1, prefetch=True)]
    for r in sm90_reports(tiles, "--tiled", "--k", "2048"):
        assert set(r["loop_load_ops"]) == {"LDG.E.128", "LDG.E.U16"} and r["spills"] == 0 and r["smem"] == 0, r


def test_every_tuned_tile_runs_where_its_rule_picks_it():
    """The data file's tile at every row bucket edge, as the host runs it (narrowed to N by fit_rows), fits every
    N that is a multiple of 64 and K of 128 the rule may see: N divides by its CTA's rows, chunks per k-step
    divide K's chunks."""
    table = tile_configs.load_table("mma_gemm")
    for entry in table["devices"].values():
        edges = sorted({r.get("max_rows", 0) for r in entry["rules"]} | {0})
        for rows in sorted({max(r + d, 0) for r in edges for d in (-1, 0, 1)} | {2 * edges[-1] + 1}):
            for k in (256, 384, 768, 1024, 2048, 7168):
                rule = next(x for x in entry["rules"] if tile_configs.rule_holds(x, dict(rows=rows, k=k)))
                for n in (64, 128, 192, 256, 1408, 1536, 2048, 4096):
                    cfg = mm.fit_rows(MmaConfig(**rule["tile"]), n)
                    assert cfg.block_t == rule["tile"]["block_t"]
                    chunks = mm.fit_tile(cfg, n, k)
                    assert chunks in cfg.chunk_choices() and chunks <= cfg.chunks, (rows, k, n)
                    assert (k // 128) % chunks == 0, (rows, k, n)


def test_host_refuses_what_the_kernel_cannot_run():
    cfg = MmaConfig(block_t=8, num_warps=8, row_groups=2)  # 256 weight rows per CTA
    with pytest.raises(KernelConfigError, match="must divide N"):
        mm.fit_tile(cfg, 1536 + 128, 2048)  # a tile given explicitly runs as it is
    assert mm.fit_rows(cfg, 1536 + 128) == MmaConfig(block_t=8, num_warps=8, row_groups=1)  # a tuned one narrows
    assert mm.fit_rows(cfg, 1536 + 64) == MmaConfig(block_t=8, num_warps=4, row_groups=1)
    assert mm.fit_tile(MmaConfig(chunks=2), 2048, 384) == 1  # 3 chunks: one per k-step
    assert mm.fit_tile(MmaConfig(chunks=4), 2048, 768) == 2  # 6 chunks: 2 per k-step
    assert mm.fit_tile(MmaConfig(chunks=4), 2048, 2048) == 4
    assert mm.fit_tile(MmaConfig(chunks=8), 2048, 768) == 2 and mm.fit_tile(MmaConfig(chunks=8), 2048, 2048) == 8
    with pytest.raises(KernelConfigError, match="chunks one of"):
        MmaConfig(chunks=3)
    with pytest.raises(KernelConfigError, match="weight_loads"):
        MmaConfig(weight_loads="cs")
    wf3 = MmaConfig(chunks=3, weights_first=True)  # 3 chunks only with every load of the step first
    assert mm.fit_tile(wf3, 2048, 768) == 3 and mm.fit_tile(wf3, 2048, 2048) == 2
    with pytest.raises(KernelConfigError, match="with weights_first"):
        MmaConfig(chunks=3)
    with pytest.raises(KernelConfigError, match="pick one"):
        MmaConfig(prefetch=True, weights_first=True)
    with pytest.raises(KernelConfigError, match="weights_first must be a bool"):
        MmaConfig(weights_first=1)
    assert not mm.usable(torch.device("cpu"), 2048, 768)
    x = torch.randn(4, 256).bfloat16()
    w = (torch.zeros(2, 64, 128, dtype=torch.uint8), torch.zeros(2, 64, 16, dtype=torch.uint8), torch.ones(2))
    offs = torch.tensor([2, 4], dtype=torch.int32)
    wg_order = act_quant.activation_operand(x, order="wgmma")
    with pytest.raises(ValueError, match=r"fp16 \[M, 2, 128\] \(pairs\)"):
        mm.grouped_w4a4_mma(wg_order.values, wg_order.global_decode, offs, *w)
    pairs = act_quant.activation_operand(x)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        mm.grouped_w4a4_mma(pairs.values, pairs.global_decode, offs, *w)


def _expert_weights(e: int, h: int, i: int):
    from quads_megatron.rollout import moe_block

    u8 = lambda *shape: torch.zeros(*shape, dtype=torch.uint8)  # noqa: E731
    return moe_block.ExpertWeights(
        u8(e, 2 * i, h // 2), u8(e, 2 * i, h // 16), torch.ones(e), u8(e, h, i // 2), u8(e, h, i // 16), torch.ones(e)
    )


def test_moe_block_picks_the_mma_gemm_where_the_data_says(monkeypatch):
    from quads_megatron.rollout import moe_block

    weights = _expert_weights(4, 256, 128)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(mm, "_capability_ok", lambda index: True)
    entry = {"used_up_to_rows": 512, "rules": [{"tile": {"block_t": 8}}]}
    monkeypatch.setattr(tile_configs, "device_entry", lambda kind, device=None: entry)
    assert moe_block.mma_gemm_usable(cuda, weights, 512) and not moe_block.mma_gemm_usable(cuda, weights, 513)
    monkeypatch.setattr(moe_block, "hopper_gemm_usable", lambda device, w, rows=None: rows > 1024)
    assert [moe_block.gemm_impl(cuda, weights, r) for r in (128, 512, 1024, 2048)] == ["mma", "mma", "triton", "wgmma"]
    assert [moe_block.gemm_impl(cuda, weights, r, mma=False) for r in (128, 2048)] == ["triton", "wgmma"]
    assert not moe_block.mma_gemm_usable(cuda, _expert_weights(4, 256, 96))  # fc2's K = 96: not a multiple of 128
    entry["rules"] = [{"tile": {"block_t": 8, "num_warps": 8, "row_groups": 2}}]  # 256 weight rows per CTA
    cfg, bt = moe_block._gemm_config(128, 2 * 704, 2048, "mma", torch.bfloat16, cuda)  # N = 1408: narrowed
    assert (cfg.num_warps, cfg.row_groups, bt) == (8, 1, 8)
    with pytest.raises(ValueError, match="impl='mma' needs a CUDA GPU"):
        moe_block.moe_w4a4(torch.randn(2, 256).bfloat16(), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2),
                           weights, impl="mma")  # fmt: skip
