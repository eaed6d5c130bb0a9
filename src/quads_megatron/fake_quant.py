"""Asymmetric QAT math: NVFP4 fake-quant of weights with a straight-through gradient.

fake_quant_weight(w, spec) returns qdq(w) (from the NVFP4 contract) in w's dtype; the backward
passes the gradient through to w unchanged (STE). The QDQ is computed once per weight version
and reused across micro-batches; a version ends when the parameter is modified in place, when
any torch optimizer steps (global post-step hook, installed by apply()), or on
mark_weights_updated().

Megatron's gradient-accumulation fusion keeps working: the returned tensor carries the
parameter's ``main_grad`` so the fused wgrad GEMM accumulates into the master buffer; when the
caller says the layer fuses wgrad (fused_wgrad=True), the backward marks the parameter
``grad_added_to_main_grad`` so the DDP hook does not add the layer's dummy gradient a second time.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from quads_megatron import nvfp4


@dataclass(frozen=True)
class FakeQuantSpec:
    """How one weight is fake-quantized.

    scale_mode: 'tensor' or 'row' global scale.
    experts_dim0: the weight is [E, N, K] holding E experts (one global scale per expert).
    amax_group: process group over which the global amax is max-reduced (expert tensor
        parallel shards of one expert), so the codes do not depend on the TP/EP layout.
    recipe: the NVFP4 variant (config nvfp4 section's weight recipe), as the converter and live sync use.
    """

    scale_mode: str = "tensor"
    experts_dim0: bool = False
    amax_group: Any = None
    recipe: nvfp4.NVFP4Recipe = nvfp4.DEFAULT_RECIPE


@dataclass
class FakeQuantStats:
    qdq_calls: int = 0
    qdq_seconds: float = 0.0
    cache_hits: int = 0


STATS = FakeQuantStats()
QDQ_BATCH_BYTES = 128 << 20  # fp32 bytes of experts QDQ'd in one pass (bounds the transient memory)
_GENERATION = [0]
# id(param) -> (weakref(param), version key, qdq tensor); entries drop when the param dies
_CACHE: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


def mark_weights_updated() -> None:
    """Invalidate every cached QDQ (call after weights change outside an optimizer step)."""
    _GENERATION[0] += 1


def clear_cache() -> None:
    _CACHE.clear()


def reset_stats() -> None:
    STATS.qdq_calls, STATS.qdq_seconds, STATS.cache_hits = 0, 0.0, 0


def _reduce_amax(a: torch.Tensor, group: Any) -> torch.Tensor:
    if group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        a = a.clone()
        torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=group)
    return a


def _qdq(x: torch.Tensor, scale_mode: str, global_amax: torch.Tensor, recipe: nvfp4.NVFP4Recipe) -> torch.Tensor:
    """Contract QDQ in x.dtype; on CUDA through its Triton twin (bit-identical: checked on the H200 for
    the plain recipe, and under the interpreter against TE's reference for every recipe)."""
    if x.is_cuda:
        from quads_megatron.kernels import nvfp4_quant

        q = nvfp4_quant.quantize(x, scale_mode, global_amax, check=False, recipe=recipe)  # type: ignore[arg-type]
        return nvfp4.dequantize(q, x.dtype)
    return nvfp4.qdq(x, scale_mode, global_amax, check=False, recipe=recipe)  # type: ignore[arg-type]


def qdq_weight(w: torch.Tensor, spec: FakeQuantSpec) -> torch.Tensor:
    """qdq(w) in w.dtype, no autograd; [E, N, K] weights with experts_dim0 get one scale per expert.

    The experts go through row-scaled QDQs whose every row carries its expert's amax: the same S_enc per
    element as a per-tensor QDQ of each expert, so the same bits, in a few launches per QDQ_BATCH_BYTES
    of experts instead of a few per expert."""
    x = w.detach()
    nvfp4.check_quantizable(x, "expert weight")
    if spec.experts_dim0:
        if x.dim() != 3:
            raise ValueError(f"experts_dim0 weight must be [E, N, K], got {tuple(x.shape)}")
        if spec.scale_mode == "tensor":
            a = x.abs().amax(dim=(1, 2)).float()
            a = _reduce_amax(a, spec.amax_group)
            per = max(1, QDQ_BATCH_BYTES // max(1, 4 * x[0].numel()))
            outs = []
            for e in range(0, x.shape[0], per):
                xs = x[e : e + per]
                rows = nvfp4.per_slice_rows(a[e : e + per], x.shape[1])  # [experts * N, 1]
                outs.append(_qdq(xs.reshape(-1, x.shape[-1]), "row", rows, spec.recipe).reshape(xs.shape))
            return outs[0] if len(outs) == 1 else torch.cat(outs)
    a = _reduce_amax(nvfp4.amax(x, spec.scale_mode), spec.amax_group)  # type: ignore[arg-type]
    return _qdq(x, spec.scale_mode, a, spec.recipe)


class _StraightThrough(torch.autograd.Function):
    """y = w_q (precomputed qdq(w)); dL/dw = dL/dy."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, w_q: torch.Tensor, fused_wgrad: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.param = w
        ctx.fused_wgrad = fused_wgrad
        return w_q.view_as(w_q)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.fused_wgrad and hasattr(ctx.param, "grad_added_to_main_grad"):
            # the host's fused wgrad GEMM already accumulated into param.main_grad; `grad` is its dummy
            ctx.param.grad_added_to_main_grad = True
        return grad, None, None


_MAIN_GRAD_ATTRS = ("main_grad", "grad_added_to_main_grad", "zero_out_wgrad", "overwrite_main_grad")


def _key(w: torch.Tensor, spec: FakeQuantSpec) -> tuple:
    return (w._version, w.data_ptr(), _GENERATION[0], spec.scale_mode, spec.experts_dim0, spec.recipe)


def _cached(w: torch.Tensor, spec: FakeQuantSpec) -> torch.Tensor | None:
    hit = _CACHE.get(id(w))
    return hit[2] if hit is not None and hit[0]() is w and hit[1] == _key(w, spec) else None


def _store(w: torch.Tensor, spec: FakeQuantSpec, w_q: torch.Tensor) -> None:
    wid = id(w)
    _CACHE[wid] = (weakref.ref(w, lambda _, wid=wid: _CACHE.pop(wid, None)), _key(w, spec), w_q)


def _straight_through(w: torch.Tensor, w_q: torch.Tensor, fused_wgrad: bool) -> torch.Tensor:
    """w_q in the forward, w's gradient through it (STE), with w's main_grad attributes."""
    if not (torch.is_grad_enabled() and w.requires_grad):
        return w_q
    out = _StraightThrough.apply(w, w_q, fused_wgrad and hasattr(w, "main_grad"))
    for name in _MAIN_GRAD_ATTRS:
        if hasattr(w, name):
            setattr(out, name, getattr(w, name))
    if hasattr(out, "grad_added_to_main_grad"):
        out.grad_added_to_main_grad = False
    return out


def fake_quant_weight(
    w: torch.Tensor, spec: FakeQuantSpec, cache: bool = True, fused_wgrad: bool = False
) -> torch.Tensor:
    """NVFP4 fake-quant of a weight with a straight-through gradient (see module docstring).

    fused_wgrad: the consuming layer accumulates wgrad straight into ``w.main_grad``
    (Megatron gradient_accumulation_fusion / TE fuse_wgrad_accumulation).
    """
    w_q = _cached(w, spec) if cache else None
    if w_q is not None:
        STATS.cache_hits += 1
    else:
        t0 = time.perf_counter()
        w_q = qdq_weight(w, spec)
        STATS.qdq_calls += 1
        STATS.qdq_seconds += time.perf_counter() - t0
        if cache:
            _store(w, spec, w_q)
    return _straight_through(w, w_q, fused_wgrad)


def fake_quant_weights(
    ws: list[torch.Tensor], spec: FakeQuantSpec, cache: bool = True, fused_wgrad: bool = False
) -> list[torch.Tensor]:
    """fake_quant_weight of each of ws, the per-expert weights of one grouped linear (each its own global
    scale): the QDQs the cache lacks are computed together (qdq_weight of their [E, N, K] stack, in stacks
    of at most QDQ_BATCH_BYTES; the same bits as one by one). Weights of other shapes or dtypes, or row
    scaling, go one by one."""
    got = [_cached(w, spec) if cache else None for w in ws]
    STATS.cache_hits += sum(q is not None for q in got)
    miss = [i for i, q in enumerate(got) if q is None]
    batch = len(miss) > 1 and spec.scale_mode == "tensor" and not spec.experts_dim0
    batch = batch and len({(ws[i].shape, ws[i].dtype, ws[i].device) for i in miss}) == 1 and ws[miss[0]].dim() == 2
    per = max(1, QDQ_BATCH_BYTES // max(1, 4 * ws[miss[0]].numel())) if batch else 0
    for c in range(0, len(miss), per) if batch else ():
        chunk = miss[c : c + per]
        t0 = time.perf_counter()
        try:
            qs = qdq_weight(torch.stack([ws[i].detach() for i in chunk]), dataclasses.replace(spec, experts_dim0=True))
        except nvfp4.NVFP4InputError:
            break  # one by one below: the error then names the weight (as fake_quant_weight's does)
        STATS.qdq_calls += len(chunk)
        STATS.qdq_seconds += time.perf_counter() - t0
        for j, i in enumerate(chunk):
            got[i] = qs[j]
            if cache:
                _store(ws[i], spec, qs[j])
    out = []
    for w, w_q in zip(ws, got, strict=True):
        if w_q is None:
            out.append(fake_quant_weight(w, spec, cache, fused_wgrad))
        else:
            out.append(_straight_through(w, w_q, fused_wgrad))
    return out


_STEP_HOOK: list[Any] = []


def install_optimizer_hook() -> None:
    """After every torch optimizer step, start a new weight version (idempotent)."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK.append(register_optimizer_step_post_hook(lambda *_: mark_weights_updated()))


def remove_optimizer_hook() -> None:
    while _STEP_HOOK:
        _STEP_HOOK.pop().remove()
