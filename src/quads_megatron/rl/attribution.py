"""Which layers carry the rollout-trainer gap: the rollout's NVFP4 numerics emulated in the trainer, one
layer at a time.

On a batch the engine sampled (its logprobs known), the trainer's logprobs are recomputed with the
rollout's expert numerics switched on at a set S of MoE layers: the expert GEMM inputs quantized per token
to NVFP4 with the arm's dynamic RAC (forward pre-hooks on the expert linears, TEGroupedMLP or
SequentialMLP), and, for arms whose trainer is BF16, the expert weights fake-quantized at S by
``quads_megatron.apply`` with ``trainer.layers = S``. For each layer L:

* ``gap_only``: mean |logp - logp_trainer| with S = {L} (what layer L alone adds);
* ``gap_without``: the same with S = all layers but L (layer L in BF16), and ``share`` = 1 -
  gap_without / gap_all: the part of the emulated gap that goes when layer L runs BF16;
* ``fc1_rel_err`` / ``fc2_rel_err``: ||x_q - x||^2 / ||x||^2 of the expert GEMM inputs at L (S = all).

``engine_gap`` (the engine's logprobs vs the trainer's) and ``emulated_vs_engine`` say how much of the
real gap the emulation explains.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from quads_megatron import nvfp4
from quads_megatron.config import RACConfig
from quads_megatron.rl.spec import ArmSpec


def expert_linears(model: torch.nn.Module) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """(Megatron layer number, 'fc1'|'fc2', module) of every routed-expert linear of a GPTModel."""
    for li, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts
        mlps = getattr(experts, "local_experts", None) or [experts]  # SequentialMLP, or TEGroupedMLP
        for mlp in mlps:
            yield li + 1, "fc1", mlp.linear_fc1
            yield li + 1, "fc2", mlp.linear_fc2


@contextlib.contextmanager
def rollout_numerics(model: torch.nn.Module, layers: set[int], arm: ArmSpec, stats: dict | None = None):
    """The arm's rollout expert numerics at the given Megatron layer numbers (see the module docstring);
    stats, if given, collects [sum ||x_q - x||^2, sum ||x||^2] per (layer, fc)."""
    import quads_megatron

    rac = RACConfig(enabled=arm.rac_ratio > 0, ratio=arm.rac_ratio)

    def make_hook(layer: int, fc: str, channels: int):
        def hook(module, args):
            x = args[0]
            flat = x.reshape(-1, x.shape[-1])
            if flat.shape[0] == 0:
                return None
            from quads_megatron.rollout import reference

            qa = reference.quantize_activation(flat.float(), None, None, channels)
            y = nvfp4.dequantize(qa.x)
            if qa.residual is not None:
                y = y + nvfp4.dequantize(qa.residual)
            if stats is not None:
                acc = stats.setdefault((layer, fc), [0.0, 0.0])
                acc[0] += float((y - flat.float()).square().sum())
                acc[1] += float(flat.float().square().sum())
            return (y.to(x.dtype).reshape(x.shape), *args[1:])

        return hook

    handles = []
    weights = not arm.qat and bool(layers)
    try:
        if weights:  # a BF16 trainer: the rollout's weights are the sync's NVFP4 codes, at these layers only
            quads_megatron.apply({"trainer": {"experts": ["routed"], "layers": sorted(layers)}}, model=model)
        for layer, fc, mod in expert_linears(model):
            if layer in layers:
                k = mod.in_features if hasattr(mod, "in_features") else mod.input_size
                handles.append(mod.register_forward_pre_hook(make_hook(layer, fc, rac.num_channels(k))))
        yield
    finally:
        for h in handles:
            h.remove()
        if weights:
            quads_megatron.remove()


def attribute(
    model: torch.nn.Module,
    seqs: torch.Tensor,
    prompt_len: int,
    engine_logp: torch.Tensor,
    arm: ArmSpec,
    micro_batch: int,
) -> dict:
    """The per-layer attribution of one batch (see the module docstring). For a QAT arm call it while the
    trainer's QUADS patches are applied; for a BF16-trainer arm, with none applied."""
    from quads_megatron.rl.trainer import answer_logprobs, chunks

    n_layers = len(model.decoder.layers)
    every = set(range(1, n_layers + 1))
    seqs = seqs.to(next(model.parameters()).device)

    @torch.no_grad()
    def logprobs(layers: set[int], stats: dict | None = None) -> torch.Tensor:
        with rollout_numerics(model, layers, arm, stats):
            out = [answer_logprobs(model, seqs[sl], prompt_len)[0].cpu() for sl in chunks(len(seqs), micro_batch)]
        return torch.cat(out)

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs().mean())

    base = logprobs(set())
    stats: dict = {}
    full = logprobs(every, stats)
    gap_all = gap(full, base)
    rows = []
    for layer in sorted(every):
        without = gap(logprobs(every - {layer}), base)
        err = {fc: stats.get((layer, fc), [0.0, 1.0]) for fc in ("fc1", "fc2")}
        rows.append(
            {
                "layer": layer,
                "gap_only": gap(logprobs({layer}), base),
                "gap_without": without,
                "share": 1 - without / gap_all if gap_all > 0 else 0.0,
                "fc1_rel_err": err["fc1"][0] / max(err["fc1"][1], 1e-30),
                "fc2_rel_err": err["fc2"][0] / max(err["fc2"][1], 1e-30),
            }
        )
    return {
        "arm": arm.name,
        "tokens": int(base.numel()),
        "engine_gap": gap(engine_logp, base),
        "emulated_gap": gap_all,
        "emulated_vs_engine": gap(full, engine_logp),
        "layers": rows,
    }
