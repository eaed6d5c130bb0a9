"""Live weight sync into a running SGLang engine: the custom weight loader of ``quads_nvfp4``.

``engine.update_weights_from_tensor(named_tensors, load_format="quads_megatron.integrations.sglang.load_weights")``
takes the trainer's packed NVFP4 expert tensors as they are, BF16 expert weights (quantized here with the
contract under the layer's NVFP4 variant, the checkpoint's weight recipe, gate and up sharing their amax)
and BF16 non-expert weights. Before anything is written every
tensor is resolved to the parameter it lands in (update_targets) and checked against it: known name,
expert in range, shape (the full tensor; the loader takes this rank's TP shard), dtype, finite values,
scale signs, gate/up pairing. One bad tensor refuses the whole update (QuadsSglangError naming the first
and the count); otherwise the model's own load_weights copies into the existing storage.

Layers that store their weights tiled (tiled_layout) are untiled once before the write and tiled again after.

A flat bucket (checkpoint.flat_buckets: one uint8 tensor and its metadata in the name) is unflattened
first and then checked and written like the tensors it holds.

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
from quads_megatron.checkpoint.live_sync import FLAT_PREFIX, unflatten_bucket
from quads_megatron.errors import QuadsSglangError
from quads_megatron.integrations.sglang import tiled_layout
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


def _is_bf16_expert_weight(target: Target, t: torch.Tensor) -> bool:
    """A BF16/FP32 expert weight bound for a quads_nvfp4 layer (quantized here)."""
    return target.quads and target.kind == "weight" and t.is_floating_point()


#: a check of values: (the problem's text, the test, the tensor); the tests are "nonfinite" (a NaN or Inf),
#: "negative" (an element < 0) and "nonpositive" (an element not > 0). They run for the whole update at
#: once (_failing: a few launches per dtype and size instead of a few per tensor, one transfer per device).
ValueCheck = tuple[str, str, torch.Tensor]


def _tensor_problem(target: Target, t: torch.Tensor) -> tuple[str | None, list[ValueCheck]]:
    """Why t cannot be written to target from its dtype and shape (else None), and the checks of its values,
    in order (the first that holds is t's problem)."""
    if target.param is None:
        return None, []
    unpacked = _is_bf16_expert_weight(target, t)
    if unpacked:
        if t.dtype not in _FLOATS:
            return f"dtype {t.dtype}, expected torch.uint8 (packed) or bfloat16/float32 (quantized here)", []
    elif target.quads:
        want = _PACKED_DTYPES.get(target.kind)
        if t.dtype != want:
            hint = " (packed) or bfloat16/float32 (quantized here)" if target.kind == "weight" else ""
            return f"dtype {t.dtype}, expected {want}{hint}", []
    elif target.param.is_floating_point():
        if t.dtype not in (*_FLOATS, target.param.dtype):
            return f"dtype {t.dtype}, expected bfloat16 or float32 for a {target.param.dtype} parameter", []
    elif t.dtype != target.param.dtype:
        return f"dtype {t.dtype}, expected {target.param.dtype}", []
    want_shape = expected_shape(target, unpacked)
    if target.is_expert and target.kind in PER_TENSOR_KINDS:
        if t.numel() != 1 or t.dim() > 1:
            return f"shape {tuple(t.shape)}, expected one scalar per expert", []
    elif t.dim() != len(want_shape) or any(w is not None and w != s for w, s in zip(want_shape, t.shape, strict=True)):
        where = f"expert {target.expert} of {target.path}" if target.is_expert else target.path or target.name
        return (
            f"shape {tuple(t.shape)}, expected {tuple(want_shape)} for {where} (the full tensor: the loader "
            "takes this rank's tensor-parallel shard itself; gather expert-TP shards first)"
        ), []
    checks: list[ValueCheck] = []
    if t.is_floating_point():
        checks.append(("has NaN/Inf values", "nonfinite", t))
    if target.quads and target.kind == "weight_scale":
        checks.append(("has negative block scales", "negative", t))
    if target.quads and target.kind in PER_TENSOR_KINDS:
        checks.append((f"{target.kind} must be positive", "nonpositive", t))
    return None, checks


JOIN_BYTES = 64 << 20  # the most bytes _failing joins into one tensor (a bounded transient copy)


def _failing(tests: list[tuple[str, torch.Tensor]]) -> list[bool]:
    """For each (test, tensor): whether the tensor fails it. Tensors of one test, dtype, device and size are
    joined (up to JOIN_BYTES) into one [count, size] tensor (as bytes, so any dtype joins) and tested in one
    pass; the answers of a device come back in one transfer."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (test, t) in enumerate(tests):
        key = (test, t.dtype, t.device, t.numel())
        if groups[key] and (len(groups[key]) + 1) * t.numel() * t.element_size() > JOIN_BYTES:
            groups[(*key, i)] = groups.pop(key)  # a full group keeps its place under a key of its own
        groups[key].append(i)
    answers: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = defaultdict(list)
    for (test, dtype, device, numel, *_), idx in groups.items():
        x = torch.cat([tests[i][1].reshape(-1).view(torch.uint8) for i in idx]).view(dtype).view(len(idx), numel)
        x = x if dtype in (torch.bfloat16, torch.float16, torch.float32) else x.float()
        bad = ~torch.isfinite(x) if test == "nonfinite" else (x < 0) if test == "negative" else ~(x > 0)
        answers[device].append((idx, bad.any(dim=1)))
    out = [False] * len(tests)
    for parts in answers.values():
        values = torch.cat([a for _, a in parts]).tolist()
        for i, v in zip([i for idx, _ in parts for i in idx], values, strict=True):
            out[i] = v
    return out


def _differing(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """For each pair of one-element tensors: whether their fp32 values differ (NaN differs), one transfer
    per device."""
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, (a, _) in enumerate(pairs):
        by_device[a.device].append(i)
    out = [False] * len(pairs)
    for device, idx in by_device.items():
        a = torch.stack([pairs[i][0].float().reshape(()) for i in idx])
        b = torch.stack([pairs[i][1].float().reshape(()).to(device) for i in idx])
        for i, v in zip(idx, (a != b).tolist(), strict=True):
            out[i] = v
    return out


def _pairing_problems(checked: list[tuple[Target, torch.Tensor]]) -> list[tuple[str, str]]:
    """Gate and up of one quads_nvfp4 expert share one global scale (one S_dec per expert in fc1):
    BF16 gate/up travel together, packed gate/up global scales travel together and are equal, their
    input scales agree; and any projection is sent either BF16 or packed, not both."""
    groups: dict[tuple[str, int], dict[tuple[str, str], tuple[Target, torch.Tensor]]] = defaultdict(dict)
    for target, t in checked:
        if target.quads:
            kind = "bf16" if _is_bf16_expert_weight(target, t) else target.kind
            groups[(target.path, target.expert)][(target.shard, kind)] = (target, t)
    found: list[tuple[str, str, tuple[torch.Tensor, torch.Tensor] | None]] = []  # None: whatever the values
    for parts in groups.values():
        for shard, other in (("w1", "w3"), ("w3", "w1"), ("w2", None)):
            bf16 = parts.get((shard, "bf16"))
            if bf16 and other and (other, "bf16") not in parts:
                found.append(
                    (bf16[0].name, "BF16 gate and up of an expert must come in the same update (shared amax)", None)
                )
            if bf16 and any((shard, k) in parts for k in ("weight_scale", "weight_scale_2")):
                found.append((bf16[0].name, "sent both as a BF16 weight and as packed NVFP4 tensors", None))
        g, u = parts.get(("w1", "weight_scale_2")), parts.get(("w3", "weight_scale_2"))
        if (g is None) != (u is None):
            name = (g or u)[0].name
            found.append((name, "send gate and up global scales together (weight_scale_2 of both)", None))
        elif g:
            found.append(
                (u[0].name, f"differs from {g[0].name}: gate and up must share one global scale", (g[1], u[1]))
            )
        g, u = parts.get(("w1", "input_scale")), parts.get(("w3", "input_scale"))
        if g and u:
            found.append((u[0].name, f"differs from {g[0].name}: gate and up read the same input", (g[1], u[1])))
    differ = iter(_differing([pair for _, _, pair in found if pair is not None]))
    return [(name, why) for name, why, pair in found if pair is None or next(differ)]


def check_update(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> list[Target]:
    """The Target of every tensor of the update, or QuadsSglangError naming the first bad one (and how
    many there are) when any is bad. Reads only; the values of the whole update are read in one go."""
    index = UpdateIndex(model)
    problems: list[tuple[int, str, str]] = []  # (position in the update, name, why)
    pending: list[tuple[int, str, Target, torch.Tensor, list[ValueCheck]]] = []
    seen: set[str] = set()
    for pos, (name, t) in enumerate(named):
        if name in seen:
            problems.append((pos, name, "appears twice in the update"))
            continue
        seen.add(name)
        if not isinstance(t, torch.Tensor):
            problems.append((pos, name, f"is a {type(t).__name__}, not a tensor"))
            continue
        try:
            target = index.resolve(name)
            problem, checks = _tensor_problem(target, t)
        except UnknownTarget as e:
            target, problem, checks = None, f"unknown: {e}", []
        if problem:
            problems.append((pos, name, problem))
        else:
            pending.append((pos, name, target, t, checks))
    flags = iter(_failing([(test, v) for *_, checks in pending for _, test, v in checks]))
    checked: list[tuple[Target, torch.Tensor]] = []
    for pos, name, target, t, checks in pending:
        holding = [why for why, _, _ in checks if next(flags)]  # consumes every flag of this tensor
        if holding:
            problems.append((pos, name, holding[0]))
        else:
            checked.append((target, t))
    found = [(name, why) for _, name, why in sorted(problems, key=lambda p: p[0])] + _pairing_problems(checked)
    if found:
        name, why = found[0]
        more = f" ({len(found)} problems in this update)" if len(found) > 1 else ""
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


def _unflattened(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The update's (name, tensor) pairs with every flat bucket replaced by the tensors it holds."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in named_tensors:
        if not (isinstance(name, str) and name.startswith(FLAT_PREFIX)):
            out.append((name, t))
            continue
        try:
            out += unflatten_bucket(name, t)
        except ValueError as e:
            raise QuadsSglangError(f"weight update refused, nothing was written: {e}") from e
    return out


def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Custom weight loader for update_weights_from_tensor (load_format = this import path).

    named_tensors: HF/ModelOpt names -> packed NVFP4 expert tensors (weight u8 [I, H/2],
    weight_scale e4m3 [I, H/16], weight_scale_2 / input_scale fp32 scalars; full, un-sharded sizes),
    BF16/FP32 expert weights, or BF16/FP32 non-expert weights. All of them are checked before the
    first write (check_update); the model's load_weights then writes in place. Flat buckets
    (checkpoint.flat_buckets) are unflattened into the tensors they hold first.
    """
    named = _unflattened(named_tensors)
    targets = check_update(model, named)
    layers = {t.path: t.module for t in targets if t.quads}
    with tiled_layout.row_major(layers.values()):  # each tiled layer untiled and tiled again once, not per tensor
        model.load_weights(_quantized_from_bf16(named, targets))
    for path, layer in layers.items():
        check_expert_params(layer, path)
