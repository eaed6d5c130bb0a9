"""Rollout math (reference, torch): W4A4 NVFP4 linear/MoE GEMMs with Residual Activation Compensation.

Activations: NVFP4 with a per-token global scale (dynamic, default) or one calibrated static
amax (ModelOpt ``input_scale`` style), both through the contract in quads_megatron.nvfp4.

RAC: R = x - dq(q(x)). On the selected 16-channel blocks S, R is quantized again with the same
per-token global scale as x (its own E4M3 block scales), and added through the same GEMM as
augmented K:  y = [dq(q(x)) | dq(q(R_S))] @ [dq(W) | dq(W)_S]^T. Because S is a set of whole
16-channel blocks, dq(W)_S uses W's own codes and block scales bit for bit (no re-quantization),
and because the residual shares x's global scale, the augmented GEMM keeps one alpha per row.

The residual is stored dense over K ([M, K/2] codes, [M, K/16] scales; zero outside S), which
serves static per-layer selection and dynamic per-token selection alike.

recipe (every function here): the activations' NVFP4 variant (nvfp4.NVFP4Recipe, the QUADS config's
nvfp4 section), for x and for its residual alike; None is plain NVFP4. The dynamic per-token global scale
is TE's row-scaled NVFP4 (row_scaled_nvfp4 / row_scaled_activation), bit for bit.
"""

from __future__ import annotations

import torch

from quads_megatron import nvfp4
from quads_megatron.errors import RACPlanError
from quads_megatron.nvfp4 import BLOCK_SIZE, NVFP4Tensor
from quads_megatron.rollout.rac_plan import QuantizedActivation, RACPlan, check_rac_selection


def activation_amax(x: torch.Tensor, static_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row global amax [M, 1]: dynamic per-token, or one calibrated static amax broadcast."""
    if static_amax is None:
        return nvfp4.amax(x, "row")
    return static_amax.detach().float().reshape(1, 1).to(x.device).expand(x.shape[0], 1)


def residual_block_scores(
    x: torch.Tensor, static_amax: torch.Tensor | None = None, recipe: nvfp4.NVFP4Recipe | None = None
) -> torch.Tensor:
    """Per-token, per-block squared residual norm: fp32 [M, K/16] (the RAC error statistic)."""
    xq = nvfp4.quantize(x, "row", activation_amax(x, static_amax), recipe=recipe)
    r = x.float() - nvfp4.dequantize(xq)
    return r.reshape(x.shape[0], -1, BLOCK_SIZE).square().sum(-1)

def dynamic_block_mask(residual: torch.Tensor, channels: int) -> torch.Tensor:
    """Per-token RAC selection: bool [M, K/16] from the residual [M, K/16, 16] (fp32).

    A block is compensated when its residual amax is >= the token's n-th largest block amax
    (n = channels / 16): the top n blocks, plus any tied with the n-th. Amax (not a sum) makes the
    score order-independent, so the Triton kernel selects exactly the same blocks.
    """
    if channels % BLOCK_SIZE:
        raise RACPlanError(f"dynamic RAC channels {channels} is not a multiple of {BLOCK_SIZE}")
    score = residual.abs().amax(-1)
    n = min(channels // BLOCK_SIZE, score.shape[1])
    if n == 0:
        return torch.zeros_like(score, dtype=torch.bool)
    return score >= score.topk(n, dim=-1).values[:, -1:]


def quantize_activation(
    x: torch.Tensor,
    plan: RACPlan | None = None,
    static_amax: torch.Tensor | None = None,
    dynamic_channels: int = 0,
    recipe: nvfp4.NVFP4Recipe | None = None,
) -> QuantizedActivation:
    """Quantize x [M, K] for W4A4 (+RAC).

    plan: static RAC selection (calibrated per layer); dynamic_channels: instead, compensate the
    top blocks of each token by residual amax (a multiple of 16, see dynamic_block_mask).
    Neither: plain W4A4.
    """
    nvfp4.check_quantizable(x, "activation")
    if x.dim() != 2:
        raise ValueError(f"activation must be [M, K], got {tuple(x.shape)}")
    check_rac_selection(x.shape[1], plan, dynamic_channels)
    a = activation_amax(x, static_amax)
    xq = nvfp4.quantize(x, "row", a, check=False, recipe=recipe)
    if plan is None and not dynamic_channels:
        return QuantizedActivation(xq, None)
    r = (x.float() - nvfp4.dequantize(xq)).reshape(x.shape[0], -1, BLOCK_SIZE)
    if plan is not None:
        mask = plan.block_mask(x.device).expand(x.shape[0], -1)
    else:
        mask = dynamic_block_mask(r, dynamic_channels)
    r = torch.where(mask.unsqueeze(-1), r, torch.zeros_like(r)).reshape(x.shape)
    return QuantizedActivation(xq, nvfp4.quantize(r, "row", a, check=False, recipe=recipe))


def _exact_values(t: NVFP4Tensor) -> torch.Tensor:
    """value(q) * s_b in fp32 (exact), without the global scale; shape [..., K]."""
    v = nvfp4.e2m1_decode(nvfp4.unpack_e2m1(t.codes))
    return (v.reshape(*v.shape[:-1], -1, BLOCK_SIZE) * t.block_scales.float().unsqueeze(-1)).reshape(v.shape)


def w4a4_linear_reference(qa: QuantizedActivation, w: NVFP4Tensor) -> torch.Tensor:
    """y [M, N] fp32 = S_dec_x * S_dec_w * ([A | R_S] @ [W | W_S]^T), exact products, fp64 sums.

    w: per-tensor NVFP4 weight [N, K] from the contract (the trainer's codes and scales).
    """
    a = _exact_values(qa.x).double()
    wv = _exact_values(w).double()
    if qa.residual is not None:
        sel = qa.residual.block_scales.float().reshape(qa.residual.block_scales.shape[0], -1) != 0
        cols = sel.any(0).repeat_interleave(BLOCK_SIZE)  # union of compensated channels
        a = torch.cat([a, _exact_values(qa.residual).double()[:, cols]], dim=1)  # augmented K
        wv = torch.cat([wv, wv[:, cols]], dim=1)  # the same weight codes and scales, reused
    y = (a @ wv.t()) * qa.x.global_decode.double() * w.global_decode.double()
    return y.float()


def grouped_w4a4_reference(
    x: torch.Tensor,
    offs: torch.Tensor,
    weights: list[NVFP4Tensor],
    plans: list[RACPlan | None] | None = None,
    static_amax: torch.Tensor | None = None,
    dynamic_channels: int = 0,
    recipe: nvfp4.NVFP4Recipe | None = None,
) -> torch.Tensor:
    """MoE grouped W4A4: rows offs[e-1]:offs[e] of x [M, K] go to expert e (offs as in torch._grouped_mm)."""
    out = x.new_zeros((x.shape[0], weights[0].shape[0]), dtype=torch.float32)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            plan = plans[e] if plans is not None else None
            qa = quantize_activation(x[start:end], plan, static_amax, dynamic_channels, recipe)
            out[start:end] = w4a4_linear_reference(qa, weights[e])
        start = end
    return out
