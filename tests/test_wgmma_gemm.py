"""The Gluon Hopper GEMM (kernels/gemm_wgmma.py, gemm_wgmma_launch.py) on a CPU machine.

* its activation operand order: activation_operand(order="wgmma") is the "pairs" operand permuted by
  operand_permutation, bit for bit (TRITON_INTERPRET=1), for plain, RAC and gated inputs;
* the kernel itself, compiled ahead of time for sm_90 with Triton's own ptxas (no GPU needed) at every
  tile the data file configs/wgmma_gemm.json holds and a few other variants: the decoded weights feed
  wgmma straight from registers (the layout conversion is asserted trivial at compile time), no register
  spills, and no register of an in-flight wgmma is rewritten on any path (kernels/sass_check.py, itself
  checked on hand-written SASS);
* the host side's use of that check (fallback to 1-step runs) and of its tile config, with the compiled
  kernel faked.
Its numbers are checked on the H200 (tests/test_gpu_cuda.py).
"""

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from quads_megatron.errors import KernelConfigError
from quads_megatron.kernels import act_quant, gemm_triton, row_tiles, sass_check, tile_configs
from quads_megatron.kernels.tile_configs import ActQuantConfig, WgmmaConfig
from quads_megatron.rollout import rac_plan

wg = pytest.importorskip("quads_megatron.kernels.gemm_wgmma_launch", reason="needs a Triton with Gluon's Hopper API")


def _pairs_to_natural(values: torch.Tensor) -> torch.Tensor:
    """[M, 2, K/2] (even, odd) -> [M, K] in natural element order."""
    return values.permute(0, 2, 1).reshape(values.shape[0], -1)


@pytest.mark.parametrize(
    "case, block_k",
    [("plain", None), ("plan", None), ("dynamic", None), ("gated", None), ("plain", 64), ("gated", 128)],
)
def test_wgmma_operand_is_the_pairs_operand_permuted(case, block_k):
    """block_k None: the whole row in registers, 128-chunks permuted there; 64: two passes, chunks too
    short to permute in registers (scattered stores); 128: two passes of whole chunks."""
    g = torch.Generator().manual_seed(5)
    m, k = 7, 256
    x = (torch.randn(m, 2 * k if case == "gated" else k, generator=g) * 3).bfloat16()
    kw = {
        "plain": {},
        "plan": {"plan": rac_plan.RACPlan(torch.tensor([0, 3, 9]), k)},
        "dynamic": {"dynamic_channels": 64},
        "gated": {"gated": True, "row_valid": torch.rand(m, generator=g) > 0.3},
    }[case]
    pairs = act_quant.activation_operand(x, config=ActQuantConfig(block_k=block_k), **kw)
    got = act_quant.activation_operand(x, order="wgmma", config=ActQuantConfig(block_k=block_k), **kw)
    assert got.order == "wgmma" and got.values.shape == (m, k)
    assert torch.equal(got.global_decode, pairs.global_decode)
    assert torch.equal(got.values, _pairs_to_natural(pairs.values)[:, wg.operand_permutation(k)])


def test_operand_permutation_is_a_permutation_of_each_chunk():
    p = wg.operand_permutation(384)
    assert torch.equal(torch.sort(p).values, torch.arange(384))
    assert torch.equal(p.reshape(3, 128) // 128, torch.arange(3)[:, None].expand(3, 128))
    # the first k16 fragment of lane t = 0 holds the low nibbles of its first code bytes 0, 1 (k 0, 2)
    assert p[:2].tolist() == [0, 2]
    with pytest.raises(ValueError, match="K % 128"):
        wg.operand_permutation(96)
    with pytest.raises(ValueError, match="K % 128"):
        act_quant.activation_operand(torch.ones(2, 96), order="wgmma")
    with pytest.raises(ValueError, match="order"):
        act_quant.activation_operand(torch.ones(2, 128), order="rows")


def test_grouped_w4a4_refuses_a_wgmma_operand():
    op = act_quant.activation_operand(torch.ones(3, 128), order="wgmma")
    codes = torch.zeros(2, 64, 64, dtype=torch.uint8)
    scales = torch.zeros(2, 64, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="'pairs'"):
        gemm_triton.grouped_w4a4(op, torch.tensor([1, 3]), codes, scales, torch.ones(2))
    assert not wg.usable(torch.device("cpu"), 64, 128)


# tiles compiled besides the data file's (BT, warps, stages, chunks, unroll, loader warps, maxnreg, ctas per SM,
# split, mask_rows, narrow, tma_store[, l2_prefetch]): multi-step runs, deep rings, unmasked rows, one and two
# loader warps, in-slot overlap, unsplit consumers, narrow tiles on one consumer partition, TMA stores at 32
# tokens and with three consumer warpgroups, a 3-slot ring at 192 weight rows, L2 prefetches by the loader
EXTRA_TILES = [
    (32, 8, 4, 2, 2, 0, None, 0, False, False, False, False),
    (16, 8, 6, 1, 8, 0, None, 0, False, False, False, False),
    (64, 8, 4, 1, 1, 0, None, 0, False, False, False, False),
    (32, 8, 2, 1, 1, 2, 80, 0, False, False, False, False),
    (16, 8, 3, 2, 1, 4, 80, 0, False, False, False, False),
    (32, 8, 3, 2, 1, 4, 80, 0, False, False, False, False),
    (128, 8, 2, 2, 2, 4, 168, 0, False, False, False, False),
    (32, 8, 4, 1, 1, 4, 80, 0, True, False, False, False),
    (128, 8, 2, 2, 2, 4, 168, 0, True, False, False, False),
    (32, 8, 3, 2, 1, 4, 80, 0, False, True, True, False),
    (64, 8, 3, 1, 1, 4, 80, 0, False, True, True, False),
    (32, 8, 3, 2, 1, 4, 80, 0, True, True, True, True),
    (128, 12, 3, 1, 1, 4, 128, 1, True, True, True, True),
    (32, 8, 3, 2, 1, 4, 80, 2, True, True, True, False, 4),
    (64, 8, 3, 1, 1, 4, 80, 0, False, True, True, False, 8),
    (128, 12, 2, 2, 1, 4, 128, 1, True, True, True, False, 2),
]


def shipped_and_extra_tiles() -> list[WgmmaConfig]:
    names = [f.name for f in dataclasses.fields(WgmmaConfig)]
    table = tile_configs.load_table("wgmma_gemm")
    shipped = [WgmmaConfig(**r["tile"]) for entry in table["devices"].values() for r in entry["rules"]]
    extra = [WgmmaConfig(**dict(zip(names[: len(t)], t, strict=True))) for t in EXTRA_TILES]
    return list(dict.fromkeys(shipped + extra))


def test_kernel_compiles_for_sm90_with_register_operand_and_async_wgmma():
    """Every tile the data file holds (all devices) and the variants above, compiled for sm_90 in a fresh
    process (the interpreter that the other tests use patches Triton's language in this one). Tiles with
    loader warps are the warp-specialized kernel; split: one consumer partition (one K loop) per warpgroup;
    narrow: a K loop of each width."""
    tiles = shipped_and_extra_tiles()
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "quads_megatron.kernels.sass_check", json.dumps([dataclasses.asdict(t) for t in tiles])],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    reports = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(reports) == len(tiles)
    for t, r in zip(tiles, reports, strict=True):
        lw, kc = t.loader_warps, t.chunks
        overlap, un = (wg.ws_overlap(kc, t.unroll), 1) if lw else (False, wg.run_length(2048, kc, t.unroll))
        widths = [t.block_t // 2, t.block_t] if t.narrow else [t.block_t]  # narrow: a K loop of each width
        assert r["hgmma_shape"] == sorted(f"64x{w}x16" for w in widths), r
        # 8 wgmma per 128-K chunk, A from registers (a shared-memory A would be a second descriptor)
        parts = t.num_warps // 4 if t.split else 1  # consumer partitions: one K loop each
        mmas = 8 * kc * un * parts * len(widths)
        assert len(r["hgmma_a_operands"]) == mmas and all(a.startswith("R") for a in r["hgmma_a_operands"]), r
        # one-partition kernel: within a run each decode overlaps the previous chunk's wgmma, the run's last
        # chunk retires all; warp-specialized: each chunk's wgmma retired before the next decode. Either way
        # one wait per chunk (ptxas serializing the wgmmas would put one after each of the 8); with in-slot
        # overlap the slot's first chunk stays in flight under the second one's decode
        want = ["0x1", "0x0"] if overlap else ["0x0"] * kc if lw else ["0x1"] * (kc * un - 1) + ["0x0"]
        copies = parts * len(widths)
        assert (r["wgmma_waits"] if lw else r["wgmma_waits"][: kc * un]) == want * copies, r
        # ... and no register an in-flight wgmma reads or accumulates into is rewritten on any path
        assert r["register_hazards"] == [], r
        # no local memory, but for the loader's register handoff in the warp-specialized kernel (a few
        # values stored just before its registers shrink to 24, reloaded after they grow); none in the K loop
        assert r["regs"] <= 255 and r["smem"] <= 227 * 1024, r
        # (three consumer warpgroups at 128 registers per thread, or 64-row tiles with two chunks a slot, the
        # H100's fastest at 8192 rows: the loader, at 24 registers, parks values per tile too; at most 24)
        parks = t.num_warps == 12 or (t.block_t == 64 and t.chunks == 2)
        handoff = r["stores_at_handoff_only"] or (parks and r["spills"] <= 24)
        assert r["loop_spills"] == 0 and (handoff if lw else r["spills"] == 0), r
        # loader warps ride in their own warpgroup, with registers handed to the consumers (setmaxnreg)
        assert r["threads"] == 32 * (t.num_warps + (4 if lw else 0)), r
        # TMA stores: one bulk store per consumer partition (full-width tiles only), none without
        assert r["tma_stores"] == (parts if t.tma_store else 0), r
        assert bool(r["setmaxnreg"]) == bool(lw), r
        # l2_prefetch: the loader asks L2 for weight chunks ahead (prefetch.global.L2), nothing else does
        assert (r["l2_prefetches"] > 0) == bool(t.l2_prefetch), r


def test_kernel_compiles_on_tiled_weights():
    """On weight_layout's tiled weights (only the weights' addresses change) the data file's first tiles (both
    kernels) compile as on row-major ones: the same wgmmas and waits, no register hazard, no K-loop spill."""
    tiles = shipped_and_extra_tiles()[:4]
    assert any(t.loader_warps for t in tiles) and not all(t.loader_warps for t in tiles)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    spec = json.dumps([dataclasses.asdict(t) for t in tiles])
    reports = {}
    for flags in ((), ("--tiled",)):
        out = subprocess.run(
            [sys.executable, "-m", "quads_megatron.kernels.sass_check", *flags, spec],
            capture_output=True,
            text=True,
            env=env,
            timeout=1200,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        reports[flags] = json.loads(out.stdout.strip().splitlines()[-1])
    for t, rows, tiled in zip(tiles, reports[()], reports[("--tiled",)], strict=True):
        for key in ("hgmma_shape", "hgmma_a_operands", "wgmma_waits", "threads", "smem"):
            assert tiled[key] == rows[key], (t, key)
        assert tiled["register_hazards"] == [] and tiled["loop_spills"] == 0, (t, tiled)


def _sass(*lines: str) -> str:
    """Triton's SASS dump format: control codes, a tab, the instruction."""
    return "\n".join(ln if ln.endswith(":") else f"--:-:-:-:1\t{ln};" for ln in lines)


MMA = "HGMMA.64x16x16.F32 R24, R40, gdesc[UR8], R24, gsb0"


def test_register_hazard_check_on_straight_line_code():
    hazards = sass_check.wgmma_register_hazards

    assert hazards(_sass("WARPGROUP.ARRIVE", MMA, "PRMT R12, R8, 0x1404, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x0")) == []
    # a write to the A operand (R40..R43) or the accumulators (R24..R31) before the wait retires them
    assert len(hazards(_sass(MMA, "PRMT R43, R8, 0x1404, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))) == 1
    assert len(hazards(_sass(MMA, "LDS.128 R28, [R2]", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))) == 1
    assert len(hazards(_sass(MMA, "IMAD.WIDE R39, R2, R3, R4", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))) == 1  # R39, R40
    # a shuffle writes its second operand, ldmatrix x4 four registers, a shared-memory atomic its first
    for write in ("SHFL.BFLY PT, R41, R2, 0x1, 0x1f", "LDSM.16.M88.4 R38, [R2]", "ATOMS.ADD R42, [R2], R3"):
        assert len(hazards(_sass(MMA, write, "WARPGROUP.DEPBAR.LE gsb0, 0x0"))) == 1, write
    assert hazards(_sass(MMA, "ISETP.GE.AND P0, PT, R40, R41, PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0")) == []  # reads
    # stores and predicated exits write no register; the write after the wait is fine
    assert hazards(_sass(MMA, "STS [R40], R41", "@P0 EXIT", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MOV R40, R2")) == []
    # wait(1) leaves the newest group in flight: the older one is retired, this one is not
    two = "HGMMA.64x16x16.F32 R56, R44, gdesc[UR8], R56, gsb0"
    wait1, wait0 = "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    assert hazards(_sass(MMA, two, wait1, "MOV R41, R2", wait0)) == []
    assert len(hazards(_sass(MMA, two, wait1, "MOV R45, R2"))) == 1


def test_register_hazard_check_follows_the_loop_back_edge():
    """The H200 failure: the wait that retires a wgmma sits in the next iteration, after a decode
    that already rewrote the wgmma's A registers."""
    hazards = sass_check.wgmma_register_hazards

    loop = ["LOOP:", "PRMT R40, R8, 0x1404, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x0", MMA, "@P1 BRA LOOP", "EXIT"]
    bad = hazards(_sass(*loop))
    assert len(bad) == 1 and "PRMT R40" in bad[0]
    fixed = loop[:1] + loop[2:3] + loop[1:2] + loop[3:]  # the wait before the decode
    assert hazards(_sass(*fixed)) == []
    # the loop's exit path runs into the epilogue without a wait: a write there is caught too
    assert len(hazards(_sass(MMA, "@P1 BRA OUT", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "OUT:", "MOV R26, RZ"))) == 1


def _cuobjdump(*code: tuple[int, str]) -> str:
    """cuobjdump -sass text for (offset, instruction) pairs: each with its encoding's two words (the
    second one's control bits: stall 2, no barriers)."""
    lines = ["", "\tcode for sm_90a", "\t\tFunction : k", '\t.headerflags\t@"EF_CUDA_SM90"']
    for offset, ins in code:
        lines.append(f"        /*{offset:04x}*/                   {ins} ;      /* 0x0000000000007918 */")
        lines.append("                                                        /* 0x000fe40000000000 */")
    return "\n".join(lines + ["\t\t.........."]) + "\n"


def test_disassembly_reads_code_past_64_kb_and_checks_it():
    """Triton's SASS dump ends at offset 0x10000 (4-digit offsets); a kernel with two compiled widths
    per consumer partition is past it. parse_cuobjdump reads every instruction, labels branch targets
    (5-digit too) and keeps the control bits; a hazard past 64 KB is found."""
    text = _cuobjdump(
        (0xFFF0, "@P0 BRA 0x10020"),
        (0x10000, MMA),
        (0x10010, "PRMT R41, R8, 0x1404, RZ"),
        (0x10020, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        (0x10030, "EXIT"),
    )
    sass = sass_check.parse_cuobjdump(text)
    assert sass.splitlines() == [
        "--:-:-:-:2\t@P0 BRA L10020;",
        f"--:-:-:-:2\t{MMA};",
        "--:-:-:-:2\tPRMT R41, R8, 0x1404, RZ;",
        "L10020:",
        "--:-:-:-:2\tWARPGROUP.DEPBAR.LE gsb0, 0x0;",
        "--:-:-:-:2\tEXIT;",
    ]
    assert len(sass_check.wgmma_register_hazards(sass)) == 1
    # control bits as Triton prints them: wait mask (decimal), read and write barriers, yield, stall
    assert sass_check._control(0x000E240000000800) == "--:-:0:-:2"
    assert sass_check._control(0x001FE20000000000) == "01:-:-:-:1"
    for bad in ("no code here", text.replace("/* 0x000fe40000000000 */", "")):
        with pytest.raises(RuntimeError):
            sass_check.parse_cuobjdump(bad)


@pytest.fixture(autouse=True)
def _fake_cubins_are_their_sass(monkeypatch):
    """The fake kernels below hand their SASS text as the cubin (nothing compiled to disassemble)."""
    monkeypatch.setattr(wg, "disassemble", lambda cubin: cubin)


class _FakeGluonLaunch_NoGPU:
    """Stands in for the compiled Gluon kernel (no sm_90 GPU here): records each launch's run length
    and hands back SASS per run length (None: a kernel whose SASS cannot be disassembled); the
    warp-specialized kernel's in-slot overlap counts as run length 2."""

    def __init__(self, sass_by_unroll: dict):
        self.sass_by_unroll, self.launches, self.consts, self.grids, self.args = sass_by_unroll, [], [], [], []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self._launch

    def _launch(self, *args, UNROLL=None, **consts):  # the warp-specialized kernel has no UNROLL
        overlap = consts.get("OVERLAP", False)
        self.launches.append(UNROLL if UNROLL is not None else f"ws{consts['LW']}" + (" overlap" if overlap else ""))
        self.consts.append(consts)
        self.args.append(args)
        run = UNROLL or (2 if overlap else 1)
        sass = self.sass_by_unroll[run]

        class Asm(dict):
            def __getitem__(self, name):
                if sass is None:
                    raise RuntimeError("no nvdisasm")
                return sass

        return type("Compiled", (), {"asm": Asm(), "hash": f"run{run}"})()


def _weights(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero weights [e, n, k] as the GEMM reads them (codes, scale bytes, S_dec)."""
    return torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n, k // 16, dtype=torch.uint8), torch.ones(e)


def _gemm_with_fake_kernel(monkeypatch, sass_by_unroll, unroll=2, calls=1):
    fake = _FakeGluonLaunch_NoGPU(sass_by_unroll)
    monkeypatch.setattr(wg, "w4a4_wgmma_kernel", fake)
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    monkeypatch.setattr(wg, "_SASS_CHECKED", {})
    monkeypatch.setattr(wg, "_ONE_STEP_RUNS", set())
    k = 512
    args = (torch.zeros(5, k, dtype=torch.float16), torch.ones(5), torch.tensor([2, 5]), *_weights(2, 64, k))
    for _ in range(calls):
        wg.grouped_w4a4_wgmma(*args, config=WgmmaConfig(block_t=16, num_warps=4, stages=3, unroll=unroll))
    return fake.launches


CLEAN = _sass(MMA, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MOV R40, RZ")
HAZARD = _sass(MMA, "PRMT R43, R8, 0x1404, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x0")


def test_gemm_keeps_multi_step_runs_whose_sass_is_clean(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _gemm_with_fake_kernel(monkeypatch, {2: CLEAN, 1: CLEAN}, calls=2) == [2, 2]


def test_gemm_falls_back_to_one_step_runs_on_a_hazard_and_remembers(monkeypatch):
    with pytest.warns(UserWarning, match="1 register hazards"):
        launches = _gemm_with_fake_kernel(monkeypatch, {2: HAZARD, 1: CLEAN}, calls=3)
    assert launches == [2, 1, 1, 1]  # the hazardous tile is launched once, then never again
    with pytest.warns(UserWarning, match="could not be read"):
        assert _gemm_with_fake_kernel(monkeypatch, {2: None, 1: None}) == [2, 1]
    with pytest.raises(RuntimeError, match="register hazard"):
        _gemm_with_fake_kernel(monkeypatch, {1: HAZARD}, unroll=1)


def test_gemm_checks_its_grouped_rows_like_the_triton_gemm(monkeypatch):
    """Both GEMMs check offs and a_rows through row_tiles.grouped_rows (kernel faked: no launch)."""
    monkeypatch.setattr(wg, "w4a4_wgmma_kernel", _FakeGluonLaunch_NoGPU({1: CLEAN}))
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    w = _weights(2, 64, 512)
    a, s = torch.zeros(5, 512, dtype=torch.float16), torch.ones(5)
    with pytest.raises(ValueError, match="a_rows must be int32/int64"):
        wg.grouped_w4a4_wgmma(a, s, torch.tensor([2, 5]), *w, a_rows=torch.zeros(3))
    with pytest.raises(ValueError, match="offs has 3 entries for 2 experts"):
        wg.grouped_w4a4_wgmma(a, s, torch.tensor([1, 2, 5]), *w)
    with pytest.raises(TypeError, match="WgmmaConfig"):
        wg.grouped_w4a4_wgmma(a, s, torch.tensor([2, 5]), *w, config={"block_t": 16})


def test_gemm_runs_the_warp_specialized_kernel_for_loader_warps(monkeypatch):
    """loader_warps > 0 launches the warp-specialized kernel (faked: no GPU) with its loader's register
    budget and the launch's cap; tiles that cannot run are refused before any launch (by the config, or
    for this N and K by the launcher); a register hazard in its SASS raises (it has no multi-step runs
    to fall back from)."""
    fake = _FakeGluonLaunch_NoGPU({1: CLEAN})
    monkeypatch.setattr(wg, "w4a4_wgmma_ws_kernel", fake)
    monkeypatch.setattr(wg, "w4a4_wgmma_kernel", _FakeGluonLaunch_NoGPU({}))  # must not be launched
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    monkeypatch.setattr(wg, "_SASS_CHECKED", {})
    k = 512
    w = _weights(2, 64, k)
    a, s, offs = torch.zeros(5, k, dtype=torch.float16), torch.ones(5), torch.tensor([2, 5])
    tile = WgmmaConfig(block_t=16, num_warps=4, stages=2, loader_warps=2, maxnreg=80)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=tile)
    assert fake.launches == ["ws2"]
    c = fake.consts[0]
    assert (c["LOADER_REGS"], c["maxnreg"], c["STAGES"], c["A_I64"]) == (wg.ws_loader_regs(16, 2), 80, 2, False)
    assert c["KC"] == 1  # the default: one 128-K chunk per ring slot
    two = WgmmaConfig(block_t=16, num_warps=4, stages=2, chunks=2, loader_warps=2)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=two)
    assert (fake.consts[1]["KC"], fake.consts[1]["LOADER_REGS"]) == (2, wg.ws_loader_regs(16, 2, 2))
    w256 = (w[0][..., :128].contiguous(), w[1][..., :16].contiguous(), w[2])  # K = 256: a 2-chunk slot = 1 step
    wg.grouped_w4a4_wgmma(a[:, :256].contiguous(), s, offs, *w256, config=dataclasses.replace(two, stages=3))
    assert fake.consts[2]["KC"] == 1  # ... which does not lower: one chunk per slot
    del fake.launches[1:], fake.grids[1:], fake.args[1:], fake.consts[1:]
    # one CTA per tile, P = the grid: its upper bound (ceil(5 rows / 16) + 2 experts) * 1 N tile
    assert fake.grids[0] == (3,) and fake.args[0][-1] == 3
    # persistent CTAs: SMs * ctas_per_sm, at most the tiles
    monkeypatch.setattr(row_tiles, "_sm_count", lambda device: 1)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=dataclasses.replace(tile, ctas_per_sm=1))
    assert fake.grids[1] == (1,) and fake.args[1][-1] == 1
    for bad in (dict(num_warps=4, loader_warps=4), dict(num_warps=4, loader_warps=3), dict(num_warps=16)):
        with pytest.raises(KernelConfigError, match="bad wgmma tiles"):
            WgmmaConfig(**{"block_t": 16, "stages": 3, "loader_warps": 0, **bad})
    # N = 64 has no room for 8 warps (128 weight rows per CTA); 2-step runs need a 3-slot ring
    for bad in (dict(num_warps=8), dict(stages=2, unroll=2, loader_warps=0, maxnreg=None)):
        with pytest.raises(KernelConfigError, match="bad wgmma tiles for N=64, K=512"):
            wg.grouped_w4a4_wgmma(a, s, offs, *w, config=dataclasses.replace(tile, **bad))
    assert fake.launches == ["ws2", "ws2"]
    monkeypatch.setattr(wg, "w4a4_wgmma_ws_kernel", _FakeGluonLaunch_NoGPU({1: HAZARD}))
    monkeypatch.setattr(wg, "_SASS_CHECKED", {})
    with pytest.raises(RuntimeError, match="register hazard"):
        wg.grouped_w4a4_wgmma(a, s, offs, *w, config=tile)


def test_warp_specialized_overlap_falls_back_to_retiring_each_chunk_and_remembers(monkeypatch):
    """unroll 2 with 2 chunks per slot asks the warp-specialized kernel (faked: no GPU) for in-slot overlap;
    its SASS decides it as for the one-partition kernel's multi-step runs."""
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    k = 512
    w = _weights(2, 64, k)
    a, s, offs = torch.zeros(5, k, dtype=torch.float16), torch.ones(5), torch.tensor([2, 5])
    tile = WgmmaConfig(block_t=16, num_warps=4, stages=2, chunks=2, unroll=2, loader_warps=2)
    for sass, launches in (({2: CLEAN}, ["ws2 overlap"] * 2), ({2: HAZARD, 1: CLEAN}, ["ws2 overlap", "ws2", "ws2"])):
        fake = _FakeGluonLaunch_NoGPU(sass)
        monkeypatch.setattr(wg, "w4a4_wgmma_ws_kernel", fake)
        monkeypatch.setattr(wg, "_SASS_CHECKED", {})
        monkeypatch.setattr(wg, "_ONE_STEP_RUNS", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wg.grouped_w4a4_wgmma(a, s, offs, *w, config=tile)
            wg.grouped_w4a4_wgmma(a, s, offs, *w, config=tile)
        assert fake.launches == launches
        assert [str(c.message) for c in caught] == (["Gluon GEMM: in-slot overlap not verified (1 register hazards); "
                                                     "retiring each chunk"] if 1 in sass else [])  # fmt: skip
    fake = _FakeGluonLaunch_NoGPU({1: CLEAN, 2: CLEAN})
    monkeypatch.setattr(wg, "w4a4_wgmma_ws_kernel", fake)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=dataclasses.replace(tile, chunks=1))  # nothing to overlap
    assert fake.launches == ["ws2"]


def _fake_ws_launch(monkeypatch) -> tuple:
    """Both Gluon kernels faked by one recorder (no GPU; clean SASS), and zero weights [2, 128, 512 / 2]."""
    fake = _FakeGluonLaunch_NoGPU({1: CLEAN})
    monkeypatch.setattr(wg, "w4a4_wgmma_ws_kernel", fake)
    monkeypatch.setattr(wg, "w4a4_wgmma_kernel", fake)  # (the tuned tiles may pick either kernel)
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    monkeypatch.setattr(wg, "_SASS_CHECKED", {})
    e, n, k = 2, 128, 512
    return fake, _weights(e, n, k), n, k


def test_split_consumers_launch_one_warpgroup_per_partition(monkeypatch):
    """split: the warp-specialized kernel (faked: no GPU) is launched with the first consumer warpgroup's
    4 warps, 4-warp code layouts and the second warpgroup's register share of the launch's cap; only with
    loader warps and 8 (or 12) consumer warps."""
    fake, w, n, k = _fake_ws_launch(monkeypatch)
    a, s, offs = torch.zeros(5, k, dtype=torch.float16), torch.ones(5), torch.tensor([2, 5])
    tile = WgmmaConfig(block_t=32, num_warps=8, stages=3, loader_warps=4, maxnreg=80)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=dataclasses.replace(tile, split=True))
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=tile)
    split, whole = fake.consts
    assert (split["SPLIT"], split["num_warps"], whole["SPLIT"], whole["num_warps"]) == (True, 4, False, 8)
    assert split["CODES_LAYOUT"] == wg.codes_layout(4) and whole["CODES_LAYOUT"] == wg.codes_layout(8)
    # 80 registers x 384 threads, less 40 x 128 for the loader: 100 each, the second warpgroup 96
    assert split["CONSUMER_REGS"] == wg.ws_consumer_regs(80, 4, 40) == 96 and split["LOADER_REGS"] == 40
    assert split["MASK_ROWS"] and whole["MASK_ROWS"]  # rows past the expert zero-filled unless asked otherwise
    assert whole["CONSUMER_REGS"] == 0
    assert wg.ws_consumer_regs(None, 4, 96) == 200  # no cap: one CTA per SM (168 registers per thread)
    for bad in (dict(loader_warps=0, maxnreg=None), dict(num_warps=4, loader_warps=2)):
        with pytest.raises(KernelConfigError, match="split=True"):
            dataclasses.replace(tile, split=True, **bad)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=dataclasses.replace(tile, mask_rows=False))
    assert not fake.consts[2]["MASK_ROWS"] and len(fake.launches) == 3
    # with no config the tuned tiles for this many rows run, their split and warps as launched
    a, s, offs = torch.zeros(2048, k, dtype=torch.float16), torch.ones(2048), torch.tensor([1024, 2048])
    wg.grouped_w4a4_wgmma(a, s, offs, *w)
    cfg = tile_configs.wgmma_config(2048, n, k=k)
    if cfg.loader_warps:
        c = fake.consts[3]
        assert (c["SPLIT"], c["NW"], c["num_warps"]) == (cfg.split, cfg.num_warps, 4 if cfg.split else cfg.num_warps)


def test_three_consumer_warpgroups_split_192_weight_rows(monkeypatch):
    """num_warps 12: three consumer partitions of 4 warps on 192 weight rows per CTA (faked launch: no GPU),
    their register shares of the 128-register cap after the loader's 104; refused without split consumers
    or where N is not a multiple of 192."""
    fake, _, _, k = _fake_ws_launch(monkeypatch)
    monkeypatch.setattr(row_tiles, "_sm_count", lambda device: 132)
    w = _weights(2, 384, k)
    a, s, offs = torch.zeros(300, k, dtype=torch.float16), torch.ones(300), torch.tensor([100, 300])
    tile = dict(block_t=128, num_warps=12, stages=2, chunks=2, loader_warps=4, maxnreg=128, ctas_per_sm=1)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=WgmmaConfig(**tile, split=True))
    c = fake.consts[0]
    assert (c["SPLIT"], c["num_warps"], c["NW"], c["LOADER_REGS"], c["CONSUMER_REGS"]) == (True, 4, 12, 104, 136)
    assert fake.grids[0] == (10,)  # persistent: min(132 SMs, (ceil(300 / 128) + 2 experts) row tiles x 2 N tiles)
    with pytest.raises(KernelConfigError, match="split=False"):
        WgmmaConfig(**tile, split=False)
    w256 = tuple(x[:, :256].contiguous() if x.dim() == 3 else x for x in w)  # N = 256
    with pytest.raises(KernelConfigError, match="bad wgmma tiles for N=256"):
        wg.grouped_w4a4_wgmma(a, s, offs, *w256, config=WgmmaConfig(**tile, split=True))
    assert len(fake.launches) == 1


def test_narrow_tiles_need_loader_warps_and_32_token_tiles(monkeypatch):
    """narrow reaches the warp-specialized kernel (faked: no GPU) as given, with the tuned tiles as they
    are; the one-partition kernel and 16-token tiles refuse narrow=True."""
    fake, w, n, k = _fake_ws_launch(monkeypatch)
    a, s, offs = torch.zeros(2048, k, dtype=torch.float16), torch.ones(2048), torch.tensor([1024, 2048])
    tile = WgmmaConfig(block_t=32, num_warps=8, stages=3, loader_warps=4, maxnreg=80, split=True)
    for narrow, bt in ((True, 32), (False, 32), (True, 64), (False, 16)):
        wg.grouped_w4a4_wgmma(a, s, offs, *w, config=dataclasses.replace(tile, narrow=narrow, block_t=bt))
    assert [(c["NARROW"], c["BT"]) for c in fake.consts] == [(True, 32), (False, 32), (True, 64), (False, 16)]
    cfg = tile_configs.wgmma_config(2048, n, k=k)
    wg.grouped_w4a4_wgmma(a, s, offs, *w)
    assert not cfg.loader_warps or fake.consts[-1]["NARROW"] == cfg.narrow
    for bad in (dict(loader_warps=0, split=False, maxnreg=None), dict(block_t=16)):
        with pytest.raises(KernelConfigError, match="narrow=True"):
            dataclasses.replace(tile, narrow=True, **bad)


def test_tma_stores_only_with_split_consumers_and_a_2_byte_output(monkeypatch):
    """tma_store: the warp-specialized kernel (faked: no GPU) gets a TMA descriptor of y in [BT, 64] boxes where
    asked, None otherwise; without split consumers the config refuses it, with an fp32 output the launcher,
    before any launch."""
    fake, w, n, k = _fake_ws_launch(monkeypatch)
    a, s, offs = torch.zeros(2048, k, dtype=torch.float16), torch.ones(2048), torch.tensor([1024, 2048])
    tile = WgmmaConfig(block_t=32, num_warps=8, stages=3, loader_warps=4, maxnreg=80, split=True)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=tile)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, config=dataclasses.replace(tile, tma_store=True))
    descs = [args[8] for args in fake.args]
    assert descs[0] is None and all(args[7].shape == (2048, n) for args in fake.args)  # y
    assert (
        descs[1].block_shape == [32, 64] and descs[1].base.shape == (2048, n) and descs[1].base.dtype == torch.bfloat16
    )
    for bad in (dict(split=False), dict(loader_warps=0, split=False, maxnreg=None)):
        with pytest.raises(KernelConfigError, match="tma_store=True"):
            dataclasses.replace(tile, tma_store=True, **bad)
    with pytest.raises(KernelConfigError, match="tma_store=True"):
        wg.grouped_w4a4_wgmma(a, s, offs, *w, torch.float32, config=dataclasses.replace(tile, tma_store=True))
    assert len(fake.launches) == 2


def test_every_tuned_tile_runs_where_its_rule_picks_it():
    """For every grouped-row count at and around each bucket edge, N (multiples of 64) and output dtype, the
    data file's tile is one the launcher accepts for that shape (fit_tile: N a multiple of its CTA's weight
    rows, enough stages for its runs, TMA stores only with a 2-byte output)."""
    edges = sorted({r.get("max_rows", 0) for e in tile_configs.load_table("wgmma_gemm")["devices"].values()
                    for r in e["rules"]} | {0})  # fmt: skip
    rows = sorted({max(r + d, 0) for r in edges for d in (-1, 0, 1)} | {2 * edges[-1] + 1})
    for device in tile_configs.load_table("wgmma_gemm")["devices"]:
        for r in rows:
            for n in range(64, 4097, 64):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    entry = tile_configs.load_table("wgmma_gemm")["devices"][device]
                    for k in (256, 384, 512, 768, 1024, 2048):
                        facts = dict(rows=r, n=n, out_bytes=dtype.itemsize, k=k)
                        rule = next(x for x in entry["rules"] if tile_configs.rule_holds(x, facts))
                        wg.fit_tile(WgmmaConfig(**rule["tile"]), n, k, dtype)
