"""The Gluon Hopper GEMM (kernels/w4a4_wgmma.py) on a CPU machine.

* its activation operand order: activation_operand(order="wgmma") is the "pairs" operand permuted by
  operand_permutation, bit for bit (TRITON_INTERPRET=1), for plain, RAC and gated inputs;
* the kernel itself, compiled ahead of time for sm_90 with Triton's own ptxas (no GPU needed): the
  decoded weights feed wgmma straight from registers (the layout conversion is asserted trivial at
  compile time), no register spills, and each wgmma retires before its register operand is
  rewritten. Its numbers are checked on the H200 (tests/test_gpu_cuda.py).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from quads_megatron.kernels import w4a4_grouped as kg

from quads_megatron import w4a4
from quads_megatron.nvfp4 import NVFP4InputError

wg = pytest.importorskip("quads_megatron.kernels.w4a4_wgmma", reason="needs a Triton with Gluon's Hopper API")


def _pairs_to_natural(values: torch.Tensor) -> torch.Tensor:
    """[M, 2, K/2] (even, odd) -> [M, K] in natural element order."""
    return values.permute(0, 2, 1).reshape(values.shape[0], -1)


@pytest.mark.parametrize("case", ["plain", "plan", "dynamic", "gated"])
def test_wgmma_operand_is_the_pairs_operand_permuted(case):
    g = torch.Generator().manual_seed(5)
    m, k = 7, 256
    x = (torch.randn(m, 2 * k if case == "gated" else k, generator=g) * 3).bfloat16()
    kw = {
        "plain": {},
        "plan": {"plan": w4a4.RACPlan(torch.tensor([0, 3, 9]), k)},
        "dynamic": {"dynamic_channels": 64},
        "gated": {"gated": True, "row_valid": torch.rand(m, generator=g) > 0.3},
    }[case]
    pairs = kg.activation_operand(x, **kw)
    got = kg.activation_operand(x, order="wgmma", **kw)
    assert got.order == "wgmma" and got.values.shape == (m, k)
    assert torch.equal(got.global_decode, pairs.global_decode)
    assert torch.equal(got.values, _pairs_to_natural(pairs.values)[:, wg.operand_permutation(k)])


def test_operand_permutation_is_a_permutation_of_each_chunk():
    p = wg.operand_permutation(384)
    assert torch.equal(torch.sort(p).values, torch.arange(384))
    assert torch.equal(p.reshape(3, 128) // 128, torch.arange(3)[:, None].expand(3, 128))
    # the first k16 fragment of lane t = 0 holds the low nibbles of its first code bytes 0, 1 (k 0, 2)
    assert p[:2].tolist() == [0, 2]
    with pytest.raises(NVFP4InputError, match="K % 128"):
        wg.operand_permutation(96)
    with pytest.raises(NVFP4InputError, match="K % 128"):
        kg.activation_operand(torch.ones(2, 96), order="wgmma")
    with pytest.raises(NVFP4InputError, match="order"):
        kg.activation_operand(torch.ones(2, 128), order="rows")


def test_grouped_w4a4_refuses_a_wgmma_operand():
    op = kg.activation_operand(torch.ones(3, 128), order="wgmma")
    codes = torch.zeros(2, 64, 64, dtype=torch.uint8)
    scales = torch.zeros(2, 64, 8, dtype=torch.uint8)
    with pytest.raises(NVFP4InputError, match="'pairs'"):
        kg.grouped_w4a4(op, torch.tensor([1, 3]), codes, scales, torch.ones(2))
    assert not wg.usable(torch.device("cpu"), 64, 128)


SASS_TOOL = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "sass_wgmma.py")


def test_kernel_compiles_for_sm90_with_register_operand_and_async_wgmma():
    """Every tile wgmma_config picks, compiled for sm_90 in a fresh process (the interpreter that the
    other tests use patches Triton's language in this one)."""
    sizes = [(128, 1536), (2048, 1536), (8192, 2048), (131072, 1536)]
    tiles = sorted(
        {(c["block_t"], c["num_warps"], c["stages"], c["chunks"]) for c in (wg.wgmma_config(r, n) for r, n in sizes)}
        | {(32, 8, 4, 2)}
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run(
        [sys.executable, SASS_TOOL, "--json", *(",".join(map(str, t)) for t in tiles)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    reports = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(reports) == len(tiles)
    for (bt, _, _, kc), r in zip(tiles, reports, strict=True):
        assert r["hgmma_shape"] == [f"64x{bt}x16"], r
        # 8 wgmma per 128-K step, A from registers (a shared-memory A would be a second descriptor)
        assert len(r["hgmma_a_operands"]) == 8 * kc and all(a.startswith("R") for a in r["hgmma_a_operands"]), r
        # every chunk's wgmma retires before the next decode overwrites its register operand
        assert set(r["wgmma_waits"]) == {"0x0"} and len(r["wgmma_waits"]) >= kc, r
        assert not r["spills"] and r["regs"] <= 255 and r["smem"] <= 227 * 1024, r
