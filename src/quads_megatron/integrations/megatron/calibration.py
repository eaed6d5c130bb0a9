"""Megatron-Core adapter for RAC calibration: record what the rollout's expert GEMMs will quantize.

    from quads_megatron.integrations.megatron.calibration import record_expert_inputs
    cfg = load_config("quads.yaml")                       # rollout.rac.metric / ratio
    with record_expert_inputs(model, config=cfg) as cal:  # forward hooks on every MoE layer's experts
        for batch in calibration_batches:
            forward_only(model, batch)                    # the script's own eval / forward step
    cal = cal.merged()                                    # all ranks (pipeline, expert, data parallel)
    calibration.save_calibration(out_dir, cal, cfg.rollout.rac.num_channels, num_experts)

For each MoE layer (MoELayer.layer_number L, 1-based, global across pipeline stages) the hooks feed
a RACCalibrator with ``<hf_prefix>.<L-1>.mlp.experts.w13``: the routed rows entering fc1 (every
token once per expert it is routed to), and ``....w2``: act(gate) * up of fc1's output, what the
rollout's fc2 quantizes (SGLang applies the router weights at the combine; Megatron folds them into
fc2's input, so the hook recomputes the activation from fc1's output instead of reading fc2's input).
Expert tensor parallel: fc2's channels are gathered over the expert-TP group and one rank of it
records. No Megatron class is patched; leaving the ``with`` removes every hook. Statistics math:
quads_megatron.rollout.calibration.RACCalibrator, with the config's rollout.rac.metric and its nvfp4
section's activation recipe (the residual the rollout's activation quantization leaves).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from quads_megatron.config import QuadsConfig, load_config
from quads_megatron.errors import QuadsPatchError
from quads_megatron.rollout import moe_block
from quads_megatron.rollout.calibration import RACCalibrator

_ACTIVATIONS = {torch.nn.functional.silu: "silu"}  # what the rollout's experts support (moe_w4a4)


def _activation_name(config: Any) -> str:
    """The rollout's name of config's expert activation; QuadsPatchError for experts whose fc1 / fc2
    inputs differ from what the rollout quantizes, or that never call linear_fc1 as a module."""
    if getattr(config, "moe_apply_probs_on_input", False):
        raise QuadsPatchError(
            "RAC calibration: moe_apply_probs_on_input scales fc1's input by the router weights; the W4A4 "
            "rollout applies them at the combine, so fc1's input here is not what it quantizes"
        )
    if getattr(config, "use_transformer_engine_op_fuser", False):
        raise QuadsPatchError(
            "RAC calibration: use_transformer_engine_op_fuser runs fused TE ops that bypass linear_fc1's "
            "forward (the hooks would record nothing); turn the op fuser off for calibration"
        )
    act = getattr(config, "activation_func", None)
    if not getattr(config, "gated_linear_unit", False) or act not in _ACTIVATIONS:
        raise QuadsPatchError(
            f"RAC calibration records what the W4A4 rollout quantizes, which serves gated experts with "
            f"{list(_ACTIVATIONS.values())} (act(gate) * up); this model has gated_linear_unit="
            f"{getattr(config, 'gated_linear_unit', None)}, activation_func={getattr(act, '__name__', act)}"
        )
    for field in ("glu_linear_offset", "activation_func_clamp_value"):
        if getattr(config, field, None):
            raise QuadsPatchError(f"RAC calibration: {field}={getattr(config, field)} is not supported")
    return _ACTIVATIONS[act]


def _expert_tp() -> tuple[int, int, Any]:
    """(rank, size, group) of the expert tensor-parallel group; (0, 1, None) without parallel state."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    return (
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_group(),
    )


def _fc1_hook(cal: RACCalibrator, prefix: str, activation: str, calls: dict[str, int], etp: tuple[int, int, Any]):
    rank, size, group = etp  # expert tensor parallel: (rank, size, group)

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        calls[prefix] += 1
        x = args[0]
        y, bias = output if isinstance(output, tuple) else (output, None)
        with torch.no_grad():
            x = x.detach().reshape(-1, x.shape[-1])
            y = y.detach().reshape(-1, y.shape[-1])
            if bias is not None:
                y = y + bias.detach()
            h = moe_block.gated_activation(y, activation)  # this rank's channels of fc2's input
            if size > 1:  # [gate_r | up_r] per rank -> h holds channel slice r of the intermediate
                parts = [torch.empty_like(h) for _ in range(size)]
                torch.distributed.all_gather(parts, h.contiguous(), group=group)
                h = torch.cat(parts, dim=-1)
            if rank == 0:  # the expert-TP ranks see the same rows
                cal.observe(f"{prefix}.w13", x)
                cal.observe(f"{prefix}.w2", h)

    return hook


def _fc1_modules(moe_layer: torch.nn.Module) -> list[torch.nn.Module]:
    experts = moe_layer.experts
    if hasattr(experts, "local_experts"):  # SequentialMLP: one MLP (its own linear_fc1) per expert
        return [e.linear_fc1 for e in experts.local_experts]
    if hasattr(experts, "linear_fc1"):  # TEGroupedMLP: one grouped linear over every local expert's rows
        return [experts.linear_fc1]
    raise QuadsPatchError(
        f"RAC calibration: experts of type {type(experts).__name__} have no linear_fc1 to observe "
        "(legacy GroupedMLP is not supported: build TEGroupedMLP or SequentialMLP experts)"
    )


def _calibrator(calibrator: RACCalibrator | None, config: Any) -> RACCalibrator:
    """The calibrator to feed: the one given, else a new one with the config's rollout.rac.metric and
    activation recipe (config: QuadsConfig, dict, YAML path, or None = $QUADS_CONFIG, else defaults)."""
    if config is None and calibrator is not None:
        return calibrator
    if config is None and os.environ.get("QUADS_CONFIG"):
        config = os.environ["QUADS_CONFIG"]
    cfg = load_config(config)
    metric, recipe = cfg.rollout.rac.metric, cfg.nvfp4.activations
    if calibrator is None:
        return RACCalibrator(metric, recipe)
    if calibrator.metric != metric:
        raise ValueError(
            f"calibrator metric {calibrator.metric!r} differs from the config's rollout.rac.metric {metric!r}"
        )
    if calibrator.recipe != recipe:
        raise ValueError(
            f"calibrator recipe {calibrator.recipe} differs from the config's nvfp4 activation recipe {recipe}"
        )
    return calibrator


@contextlib.contextmanager
def record_expert_inputs(
    model: Any,
    calibrator: RACCalibrator | None = None,
    hf_prefix: str = "model.layers",
    config: QuadsConfig | dict[str, Any] | str | os.PathLike[str] | None = None,
) -> Iterator[RACCalibrator]:
    """Hooks on every MoELayer of model (a module or a list of virtual-pipeline chunks) for the
    duration of the ``with``; yields the calibrator they feed: `calibrator`, else a new one whose
    metric is the config's rollout.rac.metric (config None: $QUADS_CONFIG, else the default 'residual')
    and whose recipe is its nvfp4 activation recipe.
    Raises QuadsPatchError for a model without MoE layers or with experts the rollout cannot serve."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    cal = _calibrator(calibrator, config)
    chunks = model if isinstance(model, (list, tuple)) else [model]
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise QuadsPatchError("RAC calibration: the model has no Megatron-Core MoELayer")
    handles, calls, etp = [], {}, _expert_tp()
    try:
        for layer in layers:
            number = getattr(layer, "layer_number", None)
            if not isinstance(number, int) or number < 1:
                raise QuadsPatchError(f"RAC calibration: MoE layer without a layer_number ({number!r})")
            prefix = f"{hf_prefix}.{number - 1}.mlp.experts"
            calls[prefix] = 0
            hook = _fc1_hook(cal, prefix, _activation_name(layer.config), calls, etp)
            handles += [mod.register_forward_hook(hook) for mod in _fc1_modules(layer)]
        yield cal
        silent = [p for p, n in calls.items() if n == 0]
        if silent and len(silent) < len(calls):  # some layers ran their experts without linear_fc1's forward
            raise QuadsPatchError(f"RAC calibration: no expert rows reached linear_fc1 of {silent[:4]}")
    finally:
        for h in handles:
            h.remove()
