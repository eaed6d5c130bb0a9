"""Live weight sync into a running SGLang engine: the custom weight loader of ``quads_nvfp4``.

``engine.update_weights_from_tensor(named_tensors, load_format="quads_megatron.integrations.sglang.load_weights")``
takes the trainer's packed NVFP4 expert tensors as they are, BF16 expert weights (quantized here with the
contract under the layer's NVFP4 variant, the checkpoint's weight recipe, gate and up sharing their amax)
and BF16 non-expert weights. Before anything is written every
tensor is resolved to the parameter it lands in (update_targets) and checked against it: known name,
expert in range, shape (the full tensor; the loader takes this rank's TP shard), dtype, finite values,
scale signs, gate/up pairing. One bad tensor refuses the whole update (QuadsSglangError naming the first
and the count); otherwise the model's own load_weights copies into the existing storage.

Expert parallelism: the tensors of experts another rank holds are checked like the others (every rank
then decides alike) and skipped at the write, as SGLang's loader does; expert ids >= num_experts are
refused. Names under another pipeline stage's layers, and names SGLang skips on purpose
(rotary_emb.inv_freq), are passed on unchecked.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from quads_megatron import nvfp4
from quads_megatron.errors import QuadsSglangError
from quads_megatron.integrations.sglang.method import check_expert_params
from quads_megatron.integrations.sglang.update_targets import (
    PER_TENSOR_KINDS,
    Target,
    UnknownTarget,
    UpdateIndex,
    expected_shape,
)

_FLOATS = (torch.bfloat16, torch.float32)
_PACKED_DTYPES = {
    "weight": torch.uint8,
    "weight_scale": torch.float8_e4m3fn,
    "weight_scale_2": torch.float32,
    "input_scale": torch.float32,
}


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t if t.dtype in (torch.bfloat16, torch.float16, torch.float32) else t.float()).all())


def _is_bf16_expert_weight(target: Target, t: torch.Tensor) -> bool:
    """A BF16/FP32 expert weight bound for a quads_nvfp4 layer (quantized here)."""
    return target.quads and target.kind == "weight" and t.is_floating_point()


def _tensor_problem(target: Target, t: torch.Tensor) -> str | None:
    """Why t cannot be written to target (dtype, shape, values), else None."""
    if target.param is None:
        return None
    unpacked = _is_bf16_expert_weight(target, t)
    if unpacked:
        if t.dtype not in _FLOATS:
            return f"dtype {t.dtype}, expected torch.uint8 (packed) or bfloat16/float32 (quantized here)"
    elif target.quads:
        want = _PACKED_DTYPES.get(target.kind)
        if t.dtype != want:
            hint = " (packed) or bfloat16/float32 (quantized here)" if target.kind == "weight" else ""
            return f"dtype {t.dtype}, expected {want}{hint}"
    elif target.param.is_floating_point():
        if t.dtype not in (*_FLOATS, target.param.dtype):
            return f"dtype {t.dtype}, expected bfloat16 or float32 for a {target.param.dtype} parameter"
    elif t.dtype != target.param.dtype:
        return f"dtype {t.dtype}, expected {target.param.dtype}"
    want_shape = expected_shape(target, unpacked)
    if target.is_expert and target.kind in PER_TENSOR_KINDS:
        if t.numel() != 1 or t.dim() > 1:
            return f"shape {tuple(t.shape)}, expected one scalar per expert"
    elif t.dim() != len(want_shape) or any(w is not None and w != s for w, s in zip(want_shape, t.shape, strict=True)):
        where = f"expert {target.expert} of {target.path}" if target.is_expert else target.path or target.name
        return (
            f"shape {tuple(t.shape)}, expected {tuple(want_shape)} for {where} (the full tensor: the loader "
            "takes this rank's tensor-parallel shard itself; gather expert-TP shards first)"
        )
    if t.is_floating_point() and not _finite(t):
        return "has NaN/Inf values"
    if target.quads and target.kind == "weight_scale" and bool((t.float() < 0).any()):
        return "has negative block scales"
    if target.quads and target.kind in PER_TENSOR_KINDS and not bool((t.float() > 0).all()):
        return f"{target.kind} must be positive"
    return None


def _pairing_problems(checked: list[tuple[Target, torch.Tensor]]) -> list[tuple[str, str]]:
    """Gate and up of one quads_nvfp4 expert share one global scale (one S_dec per expert in fc1):
    BF16 gate/up travel together, packed gate/up global scales travel together and are equal, their
    input scales agree; and any projection is sent either BF16 or packed, not both."""
    groups: dict[tuple[str, int], dict[tuple[str, str], tuple[Target, torch.Tensor]]] = defaultdict(dict)
    for target, t in checked:
        if target.quads:
            kind = "bf16" if _is_bf16_expert_weight(target, t) else target.kind
            groups[(target.path, target.expert)][(target.shard, kind)] = (target, t)
    problems = []
    for parts in groups.values():
        for shard, other in (("w1", "w3"), ("w3", "w1"), ("w2", None)):
            bf16 = parts.get((shard, "bf16"))
            if bf16 and other and (other, "bf16") not in parts:
                problems.append(
                    (bf16[0].name, "BF16 gate and up of an expert must come in the same update (shared amax)")
                )
            if bf16 and any((shard, k) in parts for k in ("weight_scale", "weight_scale_2")):
                problems.append((bf16[0].name, "sent both as a BF16 weight and as packed NVFP4 tensors"))
        g, u = parts.get(("w1", "weight_scale_2")), parts.get(("w3", "weight_scale_2"))
        if (g is None) != (u is None):
            name = (g or u)[0].name
            problems.append((name, "send gate and up global scales together (weight_scale_2 of both)"))
        elif g and not torch.equal(g[1].float().reshape(()), u[1].float().reshape(())):
            problems.append((u[0].name, f"differs from {g[0].name}: gate and up must share one global scale"))
        g, u = parts.get(("w1", "input_scale")), parts.get(("w3", "input_scale"))
        if g and u and not torch.equal(g[1].float().reshape(()), u[1].float().reshape(())):
            problems.append((u[0].name, f"differs from {g[0].name}: gate and up read the same input"))
    return problems


def check_update(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> list[Target]:
    """The Target of every tensor of the update, or QuadsSglangError naming the first bad one (and how
    many there are) when any is bad. Reads only."""
    index = UpdateIndex(model)
    problems: list[tuple[str, str]] = []
    checked: list[tuple[Target, torch.Tensor]] = []
    seen: set[str] = set()
    for name, t in named:
        if name in seen:
            problems.append((name, "appears twice in the update"))
            continue
        seen.add(name)
        if not isinstance(t, torch.Tensor):
            problems.append((name, f"is a {type(t).__name__}, not a tensor"))
            continue
        try:
            target = index.resolve(name)
            problem = _tensor_problem(target, t)
        except UnknownTarget as e:
            target, problem = None, f"unknown: {e}"
        if problem:
            problems.append((name, problem))
        else:
            checked.append((target, t))
    problems += _pairing_problems(checked)
    if problems:
        name, why = problems[0]
        more = f" ({len(problems)} problems in this update)" if len(problems) > 1 else ""
        raise QuadsSglangError(f"weight update refused, nothing was written: {name}: {why}{more}")
    return [target for target, _ in checked]


def _quantized_from_bf16(
    named: list[tuple[str, torch.Tensor]], targets: list[Target]
) -> list[tuple[str, torch.Tensor]]:
    """BF16/FP32 expert weights of quads_nvfp4 layers -> ModelOpt NVFP4 tensors (the contract under the
    layer's weight recipe; gate and up of an expert quantized with their shared amax). Everything else
    passes as it is."""
    out, gate_up = [], {}
    for (name, t), target in zip(named, targets, strict=True):
        if not _is_bf16_expert_weight(target, t):
            out.append((name, t))
        elif not target.gate_up:
            q = nvfp4.quantize(t, recipe=_weight_recipe(target))
            out += [(f"{name[: -len('.weight')]}.{k}", v) for k, v in q.to_modelopt().items()]
        else:
            gate_up.setdefault((target.path, target.expert), {})[target.shard] = (name, t, target)
    for pair in gate_up.values():  # complete: check_update refused unpaired ones
        amax = nvfp4.shared_amax(pair["w1"][1], pair["w3"][1])
        for name, w, target in pair.values():
            q = nvfp4.quantize(w, global_amax=amax, recipe=_weight_recipe(target))
            out += [(f"{name[: -len('.weight')]}.{k}", v) for k, v in q.to_modelopt().items()]
    return out


def _weight_recipe(target: Target) -> nvfp4.NVFP4Recipe:
    """The weight recipe of the quads_nvfp4 layer target lands in (its checkpoint's NVFP4 variant)."""
    return target.module.quant_method.quant_config.nvfp4_config.weights


def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Custom weight loader for update_weights_from_tensor (load_format = this import path).

    named_tensors: HF/ModelOpt names -> packed NVFP4 expert tensors (weight u8 [I, H/2],
    weight_scale e4m3 [I, H/16], weight_scale_2 / input_scale fp32 scalars; full, un-sharded sizes),
    BF16/FP32 expert weights, or BF16/FP32 non-expert weights. All of them are checked before the
    first write (check_update); the model's load_weights then writes in place.
    """
    named = list(named_tensors)
    targets = check_update(model, named)
    model.load_weights(_quantized_from_bf16(named, targets))
    for path, layer in {t.path: t.module for t in targets if t.quads}.items():
        check_expert_params(layer, path)
