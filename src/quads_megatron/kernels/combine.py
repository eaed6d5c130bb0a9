"""Top-k combine of grouped expert outputs in one Triton kernel (the tail of rollout.moe_block.moe_w4a4).

out[t] = sum_j w[t, j] * y[pos[t*k + j]]  for local experts (0 <= ids[t, j] < E), in slot order j = 0..k-1,
products and sums in fp32 (no FMA contraction), rounded once to the output dtype: the same arithmetic
as rollout.moe_block.combine(...).to(dtype) without its [T*k, H] fp32 scratch tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quads_megatron.kernels import pdl
from quads_megatron.kernels.fp4_device import round_bf16
from quads_megatron.kernels.pdl import wait_then_release


@triton.jit
def _combine_kernel(
    y_ptr,
    pos_ptr,
    ids_ptr,
    w_ptr,
    out_ptr,
    H,
    E,
    TOPK: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(TOPK):
        slot = t * TOPK + j
        e = tl.load(ids_ptr + slot)
        local = (e >= 0) & (e < E)
        row = tl.load(pos_ptr + slot).to(tl.int64)
        wj = tl.load(w_ptr + slot).to(tl.float32)
        yj = tl.load(y_ptr + row * H + cols, mask=cmask & local, other=0.0).to(tl.float32)
        acc += yj * wj
    if OUT_BF16:
        acc = round_bf16(acc)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def combine(
    y_grouped: torch.Tensor,
    order: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    out_dtype: torch.dtype,
    pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_grouped [T*k, H] (rows in rollout.moe_block.route order), order int64 [T*k], topk_ids/topk_weights
    [T, k] -> [T, H] in out_dtype (bf16/fp16/fp32). Slots of foreign experts contribute nothing.
    pos: order's inverse (int64 [T*k], e.g. kernels.route's) where known; None: computed here."""
    t, k = topk_ids.shape
    h = y_grouped.shape[1]
    if y_grouped.shape[0] != t * k or order.shape != (t * k,) or topk_weights.shape != (t, k):
        raise ValueError(
            f"combine: y {tuple(y_grouped.shape)}, order {tuple(order.shape)}, weights "
            f"{tuple(topk_weights.shape)} do not fit topk ids {tuple(topk_ids.shape)}"
        )
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"combine: out_dtype must be bf16/fp16/fp32, got {out_dtype}")
    if pos is None:
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel(), device=order.device)
    elif pos.shape != order.shape:
        raise ValueError(f"combine: pos {tuple(pos.shape)} does not fit order {tuple(order.shape)}")
    out = torch.empty((t, h), dtype=out_dtype, device=y_grouped.device)
    if t == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(h))
    _combine_kernel[(t, triton.cdiv(h, block_h))](
        y_grouped.contiguous(),
        pos,
        topk_ids.contiguous(),
        topk_weights.contiguous(),
        out,
        h,
        num_experts,
        TOPK=k,
        OUT_BF16=out_dtype == torch.bfloat16,
        BLOCK_H=block_h,
        num_warps=4,
        enable_fp_fusion=False,
        **pdl.launch_options(out.device),
    )
    return out
