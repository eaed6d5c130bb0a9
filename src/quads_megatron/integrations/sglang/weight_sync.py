"""Live weight sync into a running SGLang engine: the custom weight loader of ``quads_nvfp4``.

``engine.update_weights_from_tensor(named_tensors, load_format="quads_megatron.integrations.sglang.load_weights")``
takes the trainer's packed NVFP4 tensors as they are, or BF16 expert weights that it quantizes with the
contract; every tensor is checked before anything is written, and writes go into the existing storage.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from quads_megatron import nvfp4
from quads_megatron.errors import QuadsSglangError
from quads_megatron.integrations.sglang.method import QuadsNvfp4MoEMethod, check_expert_params

_EXPERT = re.compile(r"^(?P<base>.*\.experts\.\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<kind>\w+)$")
_GATE_UP = {"gate_proj": "up_proj", "up_proj": "gate_proj", "w1": "w3", "w3": "w1"}


def _quantized_from_bf16(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """BF16/FP32 expert weights -> ModelOpt NVFP4 tensors (contract; gate/up share their amax)."""
    out, pending = [], {}
    for name, t in named:
        m = _EXPERT.match(name)
        if m is None or m["kind"] != "weight" or not t.is_floating_point():
            out.append((name, t))
            continue
        if m["proj"] not in _GATE_UP:
            out += [(f"{m['base']}.{m['proj']}.{k}", v) for k, v in nvfp4.quantize(t).to_modelopt().items()]
            continue
        partner = f"{m['base']}.{_GATE_UP[m['proj']]}.weight"
        if partner not in pending:
            pending[name] = t
            continue
        other = pending.pop(partner)
        amax = nvfp4.shared_amax(t, other)
        for n_, w in ((name, t), (partner, other)):
            prefix = n_[: -len(".weight")]
            out += [(f"{prefix}.{k}", v) for k, v in nvfp4.quantize(w, global_amax=amax).to_modelopt().items()]
    if pending:
        raise QuadsSglangError(
            f"BF16 expert weights need gate and up of an expert in the same update (shared amax); unpaired: "
            f"{sorted(pending)[:4]}"
        )
    return out


def _validate_update(named: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse the whole update before anything is written: non-finite values, bad scales, gate/up
    global scales that differ."""
    scale2: dict[str, torch.Tensor] = {}
    for name, t in named:
        if t.is_floating_point() and not torch.isfinite(t.float()).all():
            raise QuadsSglangError(f"weight update: {name} has NaN/Inf values; nothing was written")
        m = _EXPERT.match(name)
        if m is None:
            continue
        if m["kind"] == "weight_scale" and (t.float() < 0).any():
            raise QuadsSglangError(f"weight update: {name} has negative block scales; nothing was written")
        if m["kind"] == "weight_scale_2":
            if (t.float() <= 0).any():
                raise QuadsSglangError(f"weight update: {name} must be positive; nothing was written")
            scale2[name] = t
    for name, t in scale2.items():
        m = _EXPERT.match(name)
        if m["proj"] in _GATE_UP:
            partner = f"{m['base']}.{_GATE_UP[m['proj']]}.weight_scale_2"
            if partner not in scale2:
                raise QuadsSglangError(
                    f"weight update: {name} without {partner}: send gate and up global scales together; "
                    "nothing was written"
                )
            if not torch.equal(t.float().reshape(-1), scale2[partner].float().reshape(-1)):
                raise QuadsSglangError(f"weight update: {name} differs from {partner}; nothing was written")


def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Custom weight loader for update_weights_from_tensor (load_format=this import path).

    Accepts HF/ModelOpt names: packed NVFP4 expert tensors (weight u8, weight_scale e4m3,
    weight_scale_2, input_scale) written as they are, BF16 expert weights quantized here with the
    contract, and any other (BF16) weight. Everything is checked before anything is written; the
    model's own loader then copies into the existing storage.
    """
    named = _quantized_from_bf16(list(named_tensors))
    _validate_update(named)
    model.load_weights(named)
    touched = {m["base"].rsplit(".", 1)[0] for m in map(_EXPERT.match, (n for n, _ in named)) if m}
    for mod_name, module in model.named_modules():
        if mod_name in touched and isinstance(getattr(module, "quant_method", None), QuadsNvfp4MoEMethod):
            check_expert_params(module, mod_name)
