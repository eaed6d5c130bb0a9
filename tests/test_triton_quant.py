"""Triton quantize kernel == torch contract, bit for bit (TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch
import triton
import triton.language as tl

from quads_megatron import nvfp4
from quads_megatron.kernels import fp4_device, nvfp4_quant


@pytest.mark.parametrize(
    "shape,mode,dtype",
    [
        ((1, 16), "tensor", torch.float32),
        ((7, 48), "tensor", torch.bfloat16),
        ((33, 160), "row", torch.bfloat16),
        ((2, 3, 64), "tensor", torch.float16),
        ((40, 512), "row", torch.float32),
        ((17, 1040), "tensor", torch.bfloat16),
    ],
)
def test_bit_identical_random(shape, mode, dtype):
    x = (torch.randn(shape) * torch.exp(torch.randn(shape) * 2.5)).to(dtype)
    assert nvfp4.quantize(x, mode).same_bits(nvfp4_quant.quantize(x, mode))


def test_bit_identical_edge_blocks():
    x = torch.randn(8, 64)
    x[0] = 0.0  # all-zero row
    x[1, :16] = 1e-7  # zero block scale with non-zero data
    x[2, 16:32] = 2e-5  # subnormal block scale
    x[3, :] = 1e4  # the global amax row (block scales 448)
    x[4, ::2] = -0.0
    x[5, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 0.001  # ties after scaling
    for mode in ("tensor", "row"):
        assert nvfp4.quantize(x, mode).same_bits(nvfp4_quant.quantize(x, mode))
    amax = torch.tensor(3.0)  # external (shared) amax with saturation
    assert nvfp4.quantize(x, global_amax=amax).same_bits(nvfp4_quant.quantize(x, global_amax=amax))


@triton.jit
def _e4m3_probe(v_ptr, val_ptr, code_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    r, code = fp4_device.e4m3_rne(v)
    tl.store(val_ptr + offs, r, mask=m)
    tl.store(code_ptr + offs, code, mask=m)


def test_kernel_e4m3_rounding_matches_torch_cast_everywhere():
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # all finite >= 0
    mids = (grid[1:] + grid[:-1]) / 2
    v = (
        torch.cat(
            [
                grid,
                mids,
                torch.nextafter(mids, torch.zeros_like(mids)),
                torch.nextafter(mids, torch.full_like(mids, 1e9)),
                torch.rand(20000) * 448,
                torch.rand(5000) * 0.02,
                torch.tensor([0.0, 448.0, 1e-12, 2.0**-10, 2.0**-9]),
            ]
        )
        .float()
        .clamp(max=448.0)
    )
    val = torch.empty_like(v)
    code = torch.empty(v.shape, dtype=torch.int32)
    _e4m3_probe[(triton.cdiv(v.numel(), 1024),)](v, val, code, v.numel(), BLOCK=1024)
    want = v.to(torch.float8_e4m3fn)
    assert torch.equal(val, want.float())
    assert torch.equal(code.to(torch.uint8), want.view(torch.uint8))


@triton.jit
def _e2m1_probe(v_ptr, code_ptr, val_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    tl.store(code_ptr + offs, fp4_device.e2m1_code(v), mask=m)
    tl.store(val_ptr + offs, fp4_device.e2m1_round(v), mask=m)


def test_kernel_e2m1_rounding_by_magic_add_is_the_code_value_bit_for_bit():
    """e2m1_round (the operand path's rounding, no code) == the value of the contract's code (and the
    kernel's code == the contract's) on a dense grid, every tie and its neighbours, random values in [-6, 6]."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 1e-30, 6.0, 2.0, 4.0, 0.5, 1.0])
    near = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    v = torch.cat([torch.linspace(-6, 6, 48001), near, -near, torch.rand(20000) * 12 - 6]).float().clamp(-6, 6)
    code = torch.empty(v.shape, dtype=torch.int32)
    val = torch.empty_like(v)
    _e2m1_probe[(triton.cdiv(v.numel(), 4096),)](v, code, val, v.numel(), BLOCK=4096)
    want = nvfp4.e2m1_encode(v)  # the contract's codes
    assert torch.equal(code.to(torch.uint8), want)
    assert torch.equal(val, nvfp4.e2m1_decode(want))  # (a zero's sign aside: Triton negates as 0 - x)


def test_kernel_refuses_bad_input_like_the_contract():
    with pytest.raises(nvfp4.NVFP4InputError, match="multiple of 16"):
        nvfp4_quant.quantize(torch.randn(2, 24))
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    with pytest.raises(nvfp4.NVFP4InputError, match="NaN"):
        nvfp4_quant.quantize(x)
