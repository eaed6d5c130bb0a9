"""The Gluon Hopper GEMM (kernels/w4a4_wgmma.py) on a CPU machine.

* its activation operand order: activation_operand(order="wgmma") is the "pairs" operand permuted by
  operand_permutation, bit for bit (TRITON_INTERPRET=1), for plain, RAC and gated inputs;
* the kernel itself, compiled ahead of time for sm_90 with Triton's own ptxas (no GPU needed): the
  decoded weights feed wgmma straight from registers (the layout conversion is asserted trivial at
  compile time), no register spills, and no register of an in-flight wgmma is rewritten on any path
  (kernels/sass_hazards.py, itself checked on hand-written SASS);
* the host side's use of that check (fallback to 1-step runs), with the compiled kernel faked.
Its numbers are checked on the H200 (tests/test_gpu_cuda.py).
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from quads_megatron.kernels import w4a4_grouped as kg
from quads_megatron.rollout import rac_plan

wg = pytest.importorskip("quads_megatron.kernels.w4a4_wgmma", reason="needs a Triton with Gluon's Hopper API")


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
    pairs = kg.activation_operand(x, block_k=block_k, **kw)
    got = kg.activation_operand(x, order="wgmma", block_k=block_k, **kw)
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
        kg.activation_operand(torch.ones(2, 96), order="wgmma")
    with pytest.raises(ValueError, match="order"):
        kg.activation_operand(torch.ones(2, 128), order="rows")


def test_grouped_w4a4_refuses_a_wgmma_operand():
    op = kg.activation_operand(torch.ones(3, 128), order="wgmma")
    codes = torch.zeros(2, 64, 64, dtype=torch.uint8)
    scales = torch.zeros(2, 64, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="'pairs'"):
        kg.grouped_w4a4(op, torch.tensor([1, 3]), codes, scales, torch.ones(2))
    assert not wg.usable(torch.device("cpu"), 64, 128)


SASS_TOOL = os.path.join(os.path.dirname(__file__), "..", "dev", "sass_wgmma.py")


def test_kernel_compiles_for_sm90_with_register_operand_and_async_wgmma():
    """Every tile wgmma_config picks (and a few others), compiled for sm_90 in a fresh process (the
    interpreter that the other tests use patches Triton's language in this one). Tiles with loader warps
    are the warp-specialized kernel; split: its consumer warpgroups as two partitions (two K loops)."""
    sizes = [(128, 1536), (2048, 1536), (8192, 2048), (32768, 1536), (131072, 1536), (131072, 2048), (131072, 64)]
    configs = [wg.wgmma_config(r, n) for r, n in sizes] + [wg.wgmma_config(131072, 1536, torch.float32)]
    keys = ("block_t", "num_warps", "stages", "chunks", "unroll", "loader_warps", "maxnreg", "split", "mask_rows")
    keys += ("narrow",)
    tiles = sorted(  # persistent CTAs (ctas_per_sm): the epilogue's scales staged by the loader (PDL off: 0);
        # the tiles below: rows past the expert read from row 0
        {
            tuple(int(c.get(key) or 0) for key in keys) + (0, int(bool(c.get("ctas_per_sm"))), int(c["tma_store"]))
            for c in configs
        }  # fmt: skip
        | {(32, 8, 4, 2, 2, 0, 0, 0), (16, 8, 6, 1, 8, 0, 0, 0), (64, 8, 4, 1, 1, 0, 0, 0), (32, 8, 2, 1, 1, 2, 80, 0)}
        | {(16, 8, 3, 2, 1, 4, 80, 0), (32, 8, 3, 2, 1, 4, 80, 0), (128, 8, 2, 2, 2, 4, 168, 0)}
        | {(32, 8, 4, 1, 1, 4, 80, 1), (128, 8, 2, 2, 2, 4, 168, 1)}
    )
    tiles += [(32, 8, 3, 2, 1, 4, 80, 0, 1, 1), (64, 8, 3, 1, 1, 4, 80, 0, 1, 1)]  # narrow, one consumer partition
    assert any(t[9:10] == (1,) and t[7] for t in tiles)  # the default tiles include split narrow ones ...
    assert any(t[11:12] == (1,) for t in tiles) and any(t[5] and t[11:12] == (0,) for t in tiles)  # staged or not
    tiles += [(32, 8, 3, 2, 1, 4, 80, 1, 1, 1, 0, 0, 1)]  # full tiles leave by TMA stores (and the persistent ones)
    tiles += [(128, 12, 3, 1, 1, 4, 128, 1, 1, 1, 0, 1, 1)]  # ... with three consumer warpgroups
    assert sum(t[12:] == (1,) for t in tiles) == 3 and any(t[1] == 12 and t[12:] == (0,) for t in tiles)
    assert any(t[5] for t in tiles) and any(not t[5] for t in tiles)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run(
        [sys.executable, SASS_TOOL, "--json", *(",".join(map(str, t)) for t in tiles)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    reports = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(reports) == len(tiles)
    assert any(t[5] and t[3] == 2 and t[4] > 1 for t in tiles)  # a warp-specialized tile with in-slot overlap
    for (bt, nw, _, kc, un, lw, _, split, *rest), r in zip(tiles, reports, strict=True):
        overlap, un = (kc == 2 and un > 1, 1) if lw else (False, un)  # warp-specialized kernel: 1-step runs
        widths = [bt // 2, bt] if rest[1:2] == [1] else [bt]  # narrow: a K loop of each width
        assert r["hgmma_shape"] == sorted(f"64x{w}x16" for w in widths), r
        # 8 wgmma per 128-K chunk, A from registers (a shared-memory A would be a second descriptor)
        parts = nw // 4 if split else 1  # consumer partitions: one K loop each
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
        # (three consumer warpgroups at 128 registers per thread: the loader parks a value per tile too)
        assert r["loop_spills"] == 0 and (r["stores_at_handoff_only"] or nw == 12 if lw else r["spills"] == 0), r
        # loader warps ride in their own warpgroup, with registers handed to the consumers (setmaxnreg)
        assert r["threads"] == 32 * (nw + (4 if lw else 0)), r
        # TMA stores: one bulk store per consumer partition (full-width tiles only), none without
        assert r["tma_stores"] == (parts if rest[4:5] == [1] else 0), r
        assert bool(r["setmaxnreg"]) == bool(lw), r


def _sass(*lines: str) -> str:
    """Triton's SASS dump format: control codes, a tab, the instruction."""
    return "\n".join(ln if ln.endswith(":") else f"--:-:-:-:1\t{ln};" for ln in lines)


MMA = "HGMMA.64x16x16.F32 R24, R40, gdesc[UR8], R24, gsb0"


def test_register_hazard_check_on_straight_line_code():
    from quads_megatron.kernels.sass_hazards import wgmma_register_hazards as hazards

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
    from quads_megatron.kernels.sass_hazards import wgmma_register_hazards as hazards

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
    """Triton's SASS dump stops at offset 0x10000 (4-digit offsets); a kernel with two compiled widths
    per consumer partition is past it. parse_cuobjdump reads every instruction, labels branch targets
    (5-digit too) and keeps the control bits; a hazard past 64 KB is found."""
    from quads_megatron.kernels import sass_hazards as sh

    text = _cuobjdump(
        (0xFFF0, "@P0 BRA 0x10020"),
        (0x10000, MMA),
        (0x10010, "PRMT R41, R8, 0x1404, RZ"),
        (0x10020, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        (0x10030, "EXIT"),
    )
    sass = sh.parse_cuobjdump(text)
    assert sass.splitlines() == [
        "--:-:-:-:2\t@P0 BRA L10020;",
        f"--:-:-:-:2\t{MMA};",
        "--:-:-:-:2\tPRMT R41, R8, 0x1404, RZ;",
        "L10020:",
        "--:-:-:-:2\tWARPGROUP.DEPBAR.LE gsb0, 0x0;",
        "--:-:-:-:2\tEXIT;",
    ]
    assert len(sh.wgmma_register_hazards(sass)) == 1
    # control bits as Triton prints them: wait mask (decimal), read and write barriers, yield, stall
    assert sh._control(0x000E240000000800) == "--:-:0:-:2" and sh._control(0x001FE20000000000) == "01:-:-:-:1"
    for bad in ("no code here", text.replace("/* 0x000fe40000000000 */", "")):
        with pytest.raises(RuntimeError):
            sh.parse_cuobjdump(bad)


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


def _gemm_with_fake_kernel(monkeypatch, sass_by_unroll, unroll=2, calls=1):
    fake = _FakeGluonLaunch_NoGPU(sass_by_unroll)
    monkeypatch.setattr(wg, "_w4a4_wgmma_kernel", fake)
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    monkeypatch.setattr(wg, "_SASS_CHECKED", {})
    monkeypatch.setattr(wg, "_ONE_STEP_RUNS", set())
    e, n, k = 2, 64, 512
    args = (
        torch.zeros(5, k, dtype=torch.float16),
        torch.ones(5),
        torch.tensor([2, 5]),
        torch.zeros(e, n, k // 2, dtype=torch.uint8),
        torch.zeros(e, n, k // 16, dtype=torch.uint8),
        torch.ones(e),
    )
    for _ in range(calls):
        wg.grouped_w4a4_wgmma(*args, block_t=16, num_warps=4, stages=3, chunks=1, unroll=unroll)
    return fake.launches


CLEAN = _sass(MMA, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MOV R40, RZ")
HAZARD = _sass(MMA, "PRMT R43, R8, 0x1404, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x0")


def test_gemm_keeps_multi_step_runs_whose_sass_is_clean(monkeypatch):
    import warnings

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
    """Both GEMMs check offs and a_rows through w4a4_grouped.grouped_rows (kernel faked: no launch)."""
    monkeypatch.setattr(wg, "_w4a4_wgmma_kernel", _FakeGluonLaunch_NoGPU({1: CLEAN}))
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    e, n, k = 2, 64, 512
    w = (torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n, k // 16, dtype=torch.uint8), torch.ones(e))
    a, s = torch.zeros(5, k, dtype=torch.float16), torch.ones(5)
    with pytest.raises(ValueError, match="a_rows must be int32/int64"):
        wg.grouped_w4a4_wgmma(a, s, torch.tensor([2, 5]), *w, a_rows=torch.zeros(3))
    with pytest.raises(ValueError, match="offs has 3 entries for 2 experts"):
        wg.grouped_w4a4_wgmma(a, s, torch.tensor([1, 2, 5]), *w)


def test_gemm_runs_the_warp_specialized_kernel_for_loader_warps(monkeypatch):
    """loader_warps > 0 launches the warp-specialized kernel (faked: no GPU) with its loader's register
    budget and the launch's cap; bad warp splits are refused before any launch; a register hazard in
    its SASS raises (it has no multi-step runs to fall back from)."""
    fake = _FakeGluonLaunch_NoGPU({1: CLEAN})
    monkeypatch.setattr(wg, "_w4a4_wgmma_ws_kernel", fake)
    monkeypatch.setattr(wg, "_w4a4_wgmma_kernel", _FakeGluonLaunch_NoGPU({}))  # must not be launched
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    monkeypatch.setattr(wg, "_SASS_CHECKED", {})
    e, n, k = 2, 64, 512
    w = (torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n, k // 16, dtype=torch.uint8), torch.ones(e))
    a, s, offs = torch.zeros(5, k, dtype=torch.float16), torch.ones(5), torch.tensor([2, 5])
    wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=16, num_warps=4, stages=2, loader_warps=2, maxnreg=80)
    assert fake.launches == ["ws2"]
    c = fake.consts[0]
    assert (c["LOADER_REGS"], c["maxnreg"], c["STAGES"], c["A_I64"]) == (wg.ws_loader_regs(16, 2), 80, 2, False)
    assert c["KC"] == 1  # the default: one 128-K chunk per ring slot
    wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=16, num_warps=4, stages=2, chunks=2, loader_warps=2)
    assert (fake.consts[1]["KC"], fake.consts[1]["LOADER_REGS"]) == (2, wg.ws_loader_regs(16, 2, 2))
    w256 = (w[0][..., :128].contiguous(), w[1][..., :16].contiguous(), w[2])  # K = 256: a 2-chunk slot = 1 step
    wg.grouped_w4a4_wgmma(a[:, :256].contiguous(), s, offs, *w256, block_t=16, num_warps=4, chunks=2, loader_warps=2)
    assert fake.consts[2]["KC"] == 1  # ... which does not lower: one chunk per slot
    del fake.launches[1:], fake.grids[1:], fake.args[1:], fake.consts[1:]
    # one CTA per tile, P = the grid: its upper bound (ceil(5 rows / 16) + 2 experts) * 1 N tile
    assert fake.grids[0] == (3,) and fake.args[0][-1] == 3
    monkeypatch.setattr(wg, "_sm_count", lambda device: 1)  # persistent CTAs: SMs * ctas_per_sm, at most the tiles
    wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=16, num_warps=4, stages=2, loader_warps=2, ctas_per_sm=1)
    assert fake.grids[1] == (1,) and fake.args[1][-1] == 1
    for bad in (dict(num_warps=4, loader_warps=4), dict(num_warps=4, loader_warps=3), dict(num_warps=16)):
        with pytest.raises(ValueError, match="bad tiles"):
            wg.grouped_w4a4_wgmma(a, s, offs, *w, **{"block_t": 16, "stages": 3, "loader_warps": 0, **bad})
    assert fake.launches == ["ws2", "ws2"]
    monkeypatch.setattr(wg, "_w4a4_wgmma_ws_kernel", _FakeGluonLaunch_NoGPU({1: HAZARD}))
    monkeypatch.setattr(wg, "_SASS_CHECKED", {})
    with pytest.raises(RuntimeError, match="register hazard"):
        wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=16, num_warps=4, stages=2, loader_warps=2)


def test_warp_specialized_overlap_falls_back_to_retiring_each_chunk_and_remembers(monkeypatch):
    """unroll 2 with 2 chunks per slot asks the warp-specialized kernel (faked: no GPU) for in-slot overlap;
    its SASS decides it as for the one-partition kernel's multi-step runs."""
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    e, n, k = 2, 64, 512
    w = (torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n, k // 16, dtype=torch.uint8), torch.ones(e))
    a, s, offs = torch.zeros(5, k, dtype=torch.float16), torch.ones(5), torch.tensor([2, 5])
    tile = dict(block_t=16, num_warps=4, stages=2, chunks=2, unroll=2, loader_warps=2)
    for sass, launches in (({2: CLEAN}, ["ws2 overlap"] * 2), ({2: HAZARD, 1: CLEAN}, ["ws2 overlap", "ws2", "ws2"])):
        fake = _FakeGluonLaunch_NoGPU(sass)
        monkeypatch.setattr(wg, "_w4a4_wgmma_ws_kernel", fake)
        monkeypatch.setattr(wg, "_SASS_CHECKED", {})
        monkeypatch.setattr(wg, "_ONE_STEP_RUNS", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wg.grouped_w4a4_wgmma(a, s, offs, *w, **tile)
            wg.grouped_w4a4_wgmma(a, s, offs, *w, **tile)
        assert fake.launches == launches
        assert [str(c.message) for c in caught] == (["Gluon GEMM: in-slot overlap not verified (1 register hazards); "
                                                     "retiring each chunk"] if 1 in sass else [])  # fmt: skip
    fake = _FakeGluonLaunch_NoGPU({1: CLEAN, 2: CLEAN})
    monkeypatch.setattr(wg, "_w4a4_wgmma_ws_kernel", fake)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, **{**tile, "chunks": 1})  # one chunk per slot: nothing to overlap
    assert fake.launches == ["ws2"]


def _fake_ws_launch(monkeypatch) -> tuple:
    """The warp-specialized kernel faked (no GPU; clean SASS), and zero weights [2, 128, 512 / 2] for it."""
    fake = _FakeGluonLaunch_NoGPU({1: CLEAN})
    monkeypatch.setattr(wg, "_w4a4_wgmma_ws_kernel", fake)
    monkeypatch.setattr(wg, "usable", lambda device, n, k: True)
    monkeypatch.setattr(wg, "_SASS_CHECKED", {})
    e, n, k = 2, 128, 512
    w = (torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n, k // 16, dtype=torch.uint8), torch.ones(e))
    return fake, w, n, k


def test_split_consumers_launch_one_warpgroup_per_partition(monkeypatch):
    """split: the warp-specialized kernel (faked: no GPU) is launched with the first consumer warpgroup's
    4 warps, 4-warp code layouts and the second warpgroup's register share of the launch's cap; only with
    loader warps and 8 consumer warps."""
    fake, w, n, k = _fake_ws_launch(monkeypatch)
    a, s, offs = torch.zeros(5, k, dtype=torch.float16), torch.ones(5), torch.tensor([2, 5])
    tile = dict(block_t=32, num_warps=8, stages=3, loader_warps=4, maxnreg=80)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, **tile, split=True)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, **tile)
    split, whole = fake.consts
    assert (split["SPLIT"], split["num_warps"], whole["SPLIT"], whole["num_warps"]) == (True, 4, False, 8)
    assert split["CODES_LAYOUT"] == wg._codes_layout(4) and whole["CODES_LAYOUT"] == wg._codes_layout(8)
    # 80 registers x 384 threads, less 40 x 128 for the loader: 100 each, the second warpgroup 96
    assert split["CONSUMER_REGS"] == wg.ws_consumer_regs(80, 4, 40) == 96 and split["LOADER_REGS"] == 40
    assert split["MASK_ROWS"] and whole["MASK_ROWS"]  # rows past the expert zero-filled unless asked otherwise
    assert whole["CONSUMER_REGS"] == 0
    assert wg.ws_consumer_regs(None, 4, 96) == 200  # no cap: one CTA per SM (168 registers per thread)
    for bad in (dict(loader_warps=0), dict(num_warps=4, loader_warps=2)):
        with pytest.raises(ValueError, match="split=True"):
            wg.grouped_w4a4_wgmma(a, s, offs, *w, **{**tile, **bad}, split=True)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, **tile, mask_rows=False)
    assert not fake.consts[2]["MASK_ROWS"] and len(fake.launches) == 3
    # the default tiles at 2048 grouped rows split their consumers; tiles given by the caller do not unless asked
    a, s = torch.zeros(2048, k, dtype=torch.float16), torch.ones(2048)
    offs = torch.tensor([1024, 2048])
    wg.grouped_w4a4_wgmma(a, s, offs, *w)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=32, num_warps=4, stages=3, loader_warps=2)
    assert [c["SPLIT"] for c in fake.consts[3:]] == [True, False]
    assert wg.wgmma_config(2048, n)["split"] and fake.consts[3]["num_warps"] == 4


def test_three_consumer_warpgroups_split_192_weight_rows(monkeypatch):
    """num_warps 12 (the prefill tiles where N % 192 == 0): three consumer partitions of 4 warps on 192 weight
    rows per CTA (faked launch: no GPU), their register shares of the 128-register cap after the loader's
    104; refused without split consumers or where N is not a multiple of 192."""
    fake, _, _, k = _fake_ws_launch(monkeypatch)
    monkeypatch.setattr(wg, "_sm_count", lambda device: 132)
    e, n = 2, 384
    w = (torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n, k // 16, dtype=torch.uint8), torch.ones(e))
    a, s, offs = torch.zeros(300, k, dtype=torch.float16), torch.ones(300), torch.tensor([100, 300])
    tile = dict(block_t=128, num_warps=12, stages=2, chunks=2, loader_warps=4, maxnreg=128, ctas_per_sm=1)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, **tile, split=True)
    c = fake.consts[0]
    assert (c["SPLIT"], c["num_warps"], c["NW"], c["LOADER_REGS"], c["CONSUMER_REGS"]) == (True, 4, 12, 104, 136)
    assert fake.grids[0] == (10,)  # persistent: min(132 SMs, (ceil(300 / 128) + 2 experts) row tiles x 2 N tiles)
    with pytest.raises(ValueError, match="bad tiles"):
        wg.grouped_w4a4_wgmma(a, s, offs, *w, **tile, split=False)
    w2048 = tuple(x[:, :256].contiguous() if x.dim() == 3 else x for x in w)  # N = 256
    with pytest.raises(ValueError, match="bad tiles"):
        wg.grouped_w4a4_wgmma(a, s, offs, *w2048, **tile, split=True)
    assert len(fake.launches) == 1


def test_narrow_tiles_by_default_and_need_loader_warps_and_32_token_tiles(monkeypatch):
    """narrow: the warp-specialized kernel (faked: no GPU) gets NARROW with the default tiles at 2048 rows
    (also with another block_t >= 32) and where asked; not when told not to, not (left to the config) on
    16-token tiles nor on tiles given with their loader warps; the one-partition kernel and 16-token
    tiles refuse narrow=True."""
    fake, w, n, k = _fake_ws_launch(monkeypatch)
    a, s, offs = torch.zeros(2048, k, dtype=torch.float16), torch.ones(2048), torch.tensor([1024, 2048])
    wg.grouped_w4a4_wgmma(a, s, offs, *w)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, narrow=False)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=16)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=16, narrow=False)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=64, narrow=True)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=64)
    # a tile given with its loader warps (not the configured kernel) runs full width unless asked
    wg.grouped_w4a4_wgmma(a, s, offs, *w, block_t=32, num_warps=4, stages=3, loader_warps=2)
    assert [c["NARROW"] for c in fake.consts] == [True, False, False, False, True, True, False]
    assert [c["BT"] for c in fake.consts] == [32, 32, 16, 16, 64, 64, 32]
    for bad in (dict(loader_warps=0), dict(block_t=16, num_warps=8, stages=3, loader_warps=4)):
        with pytest.raises(ValueError, match="narrow=True"):
            wg.grouped_w4a4_wgmma(a, s, offs, *w, **bad, narrow=True)
    assert len(fake.launches) == 7


def test_tma_stores_with_the_persistent_tiles_and_only_with_split_consumers_and_a_2_byte_output(monkeypatch):
    """tma_store: the warp-specialized kernel (faked: no GPU) gets a TMA descriptor of y in [BT, 64] boxes where
    asked and with the persistent default tiles (131072 rows), None otherwise; without split consumers or with
    an fp32 output it is refused before any launch."""
    fake, w, n, k = _fake_ws_launch(monkeypatch)
    a, s, offs = torch.zeros(2048, k, dtype=torch.float16), torch.ones(2048), torch.tensor([1024, 2048])
    tile = dict(block_t=32, num_warps=8, stages=3, loader_warps=4, maxnreg=80, split=True)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, **tile)
    wg.grouped_w4a4_wgmma(a, s, offs, *w, **tile, tma_store=True)
    wg.grouped_w4a4_wgmma(a, s, offs, *w)  # the default tiles at 2048 rows: plain stores
    descs = [args[8] for args in fake.args]
    assert descs[0] is None and descs[2] is None and all(args[7].shape == (2048, n) for args in fake.args)  # y
    assert (
        descs[1].block_shape == [32, 64] and descs[1].base.shape == (2048, n) and descs[1].base.dtype == torch.bfloat16
    )
    assert [wg.wgmma_config(r, 2048)["tma_store"] for r in (2048, 32768, 131072)] == [False, True, True]
    assert (
        not wg.wgmma_config(131072, 2048, torch.float32)["tma_store"] and not wg.wgmma_config(131072, 64)["tma_store"]
    )
    for bad in (dict(split=False), dict(loader_warps=0, split=False)):
        with pytest.raises(ValueError, match="tma_store=True"):
            wg.grouped_w4a4_wgmma(a, s, offs, *w, **{**tile, **bad}, tma_store=True)
    with pytest.raises(ValueError, match="tma_store=True"):
        wg.grouped_w4a4_wgmma(a, s, offs, *w, torch.float32, **tile, tma_store=True)
    assert len(fake.launches) == 3


def test_wgmma_config_uses_the_warp_specialized_kernel_above_1024_rows_persistent_above_16384():
    for rows, n in [
        (128, 1536),
        (1024, 1536),
        (1025, 1536),
        (3072, 1536),
        (3073, 1536),
        (4096, 1536),
        (4097, 1536),
        (16384, 1536),
        (16385, 1536),
        (131072, 2048),
        (131072, 64),
    ]:
        cfg = wg.wgmma_config(rows, n)
        lw = cfg.get("loader_warps", 0)
        assert (lw > 0) == (rows > 1024 and n % 128 == 0), (rows, cfg)
        # split consumers (one partition per warpgroup) wherever the warp-specialized kernel runs
        assert cfg["split"] == (lw > 0), (rows, cfg)
        bt = 16 if rows <= 1024 else 32 if rows <= 3072 else 64 if rows <= 16384 else 128
        assert cfg["block_t"] == (bt if n % 128 == 0 else min(bt, 64)), (rows, cfg)
        assert (cfg.get("ctas_per_sm", 0) > 0) == (rows > 16384 and n % 128 == 0), (rows, cfg)
        assert cfg["mask_rows"], (rows, cfg)  # rows past the expert zero-filled at every size
        # half-width tiles for experts with few rows left wherever the warp-specialized kernel runs
        assert cfg["narrow"] == (lw > 0), (rows, cfg)
        assert n % (16 * cfg["num_warps"]) == 0 and 32 * lw <= 16 * cfg["num_warps"], (rows, n, cfg)
    # 128-token tiles: three consumer warpgroups where N % 192 == 0 (2 chunks per slot, no in-slot overlap, no
    # TMA stores), else two with in-slot overlap, but for an fp32 output (its epilogue scratch)
    big, big2048, big32 = (wg.wgmma_config(131072, n, dt) for n, dt in ((1536, torch.bfloat16), (2048, torch.bfloat16),
                                                                        (1536, torch.float32)))  # fmt: skip
    assert (big["block_t"], big["num_warps"], big["chunks"], big["unroll"], big["stages"]) == (128, 12, 2, 1, 2)
    assert (big["maxnreg"], big["tma_store"]) == (128, False) and wg.wgmma_config(32768, 1536)["num_warps"] == 12
    assert (big2048["num_warps"], big2048["chunks"], big2048["unroll"], big2048["stages"]) == (8, 2, 2, 2)
    assert big2048["tma_store"] and wg.wgmma_config(16384, 1536)["num_warps"] == 8
    assert (big32["block_t"], big32["num_warps"], big32["chunks"], big32["stages"]) == (128, 8, 1, 3)


def test_cost_probe_rewrites_still_match_the_kernel(monkeypatch):
    """benchmarks/probe_wgmma_costs.py and probe_act_traffic.py time scratch variants made by rewriting this
    kernel's source; each rewrite must still find its text as often as it expects (else the probe would time
    something else)."""
    sys.path.append(os.path.join(os.path.dirname(__file__), "..", "dev"))
    import probe_act_traffic as traffic
    import probe_wgmma_costs as costs

    assert {"loads only", "no loads", "no decode", "no MMA"} <= set(costs.VARIANTS)
    monkeypatch.setattr(costs, "VARIANTS", {**costs.VARIANTS, **traffic.VARIANTS})  # + its loader / epilogue ones
    for name in costs.VARIANTS:
        mod = costs.variant(name)
        assert mod.__file__ != wg.__file__ and callable(mod.grouped_w4a4_wgmma), name
