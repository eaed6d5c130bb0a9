"""RAC calibration: per-layer statistics over calibration batches, plans and files for the converter.

RACCalibrator records, per GEMM (``<moe prefix>.w13`` / ``.w2``), a block score over K and the max |x|;
save_calibration writes ``rac_plans.safetensors``, ``input_amax.json`` and the raw scores.
"""

from __future__ import annotations

import torch

from quads_megatron import nvfp4
from quads_megatron.errors import RACPlanError
from quads_megatron.nvfp4 import BLOCK_SIZE
from quads_megatron.rollout.rac_plan import RACPlan
from quads_megatron.rollout.reference import residual_block_scores


class RACCalibrator:
    """Records per-layer RAC statistics over calibration batches and turns them into plans.

    metric 'residual': squared residual norm per 16-channel block, summed over rows (the error RAC
    removes); metric 'amax': max |x| per block (ARCQuant-style outlier statistic). Either way it also
    keeps each layer's max |x| (``amax``: a static ``input_scale``'s calibration) and its row count.
    Layers are named by the caller; ``<moe prefix>.w13`` / ``.w2`` is what the converter and the SGLang
    method read (see save_calibration). recipe: the activations' NVFP4 variant (the QUADS config's nvfp4
    section), under which the residual is what the rollout leaves (None: plain NVFP4).
    """

    def __init__(self, metric: str = "residual", recipe: nvfp4.NVFP4Recipe | None = None) -> None:
        if metric not in ("residual", "amax"):
            raise ValueError(f"metric must be 'residual' or 'amax', got {metric!r}")
        self.metric = metric
        self.recipe = nvfp4._recipe(recipe)
        self.stats: dict[str, torch.Tensor] = {}
        self.amax: dict[str, float] = {}
        self.tokens: dict[str, int] = {}

    def observe(self, layer: str, x: torch.Tensor) -> None:
        """x: [..., K] activations the GEMM `layer` quantizes (any float dtype, any device); rows with
        NaN/Inf are refused (NVFP4InputError naming the layer) before anything is recorded."""
        x2 = x.detach().reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:
            return
        nvfp4.check_quantizable(x2, f"calibration input of {layer}")
        if self.metric == "residual":
            s = residual_block_scores(x2, recipe=self.recipe).sum(0).cpu()
        else:
            s = x2.abs().float().reshape(x2.shape[0], -1, BLOCK_SIZE).amax(dim=(0, 2)).cpu()
        self._add({layer: s}, {layer: float(x2.abs().max())}, {layer: x2.shape[0]})

    def _add(self, stats: dict[str, torch.Tensor], amax: dict[str, float], tokens: dict[str, int]) -> None:
        for name, s in stats.items():
            old = self.stats.get(name)
            if old is not None and old.shape != s.shape:
                raise RACPlanError(f"calibration of {name}: K/16 = {s.numel()} here, {old.numel()} before")
            if old is None:
                self.stats[name] = s.clone()
            else:
                self.stats[name] = old + s if self.metric == "residual" else torch.maximum(old, s)
        for name, a in amax.items():
            self.amax[name] = max(self.amax.get(name, 0.0), a)
        for name, n in tokens.items():
            self.tokens[name] = self.tokens.get(name, 0) + n

    def merged(self, group: object = None) -> RACCalibrator:
        """Every rank's records of `group` (default: the whole world) merged into a new calibrator,
        the same on each rank: residual scores and row counts summed, maxima kept. Ranks may hold
        different layers (pipeline stages) or different rows of a layer (data / expert parallel).
        Without torch.distributed initialized: a copy of this one."""
        out = RACCalibrator(self.metric, self.recipe)
        mine = (self.metric, self.recipe.to_dict(), self.stats, self.amax, self.tokens)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            every: list = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(every, mine, group=group)
        else:
            every = [mine]
        for metric, recipe, stats, amax, tokens in every:
            if metric != self.metric:
                raise ValueError(f"cannot merge calibrations of metric {metric!r} into {self.metric!r}")
            if recipe != self.recipe.to_dict():
                raise ValueError(f"cannot merge calibrations under recipe {recipe} into {self.recipe.to_dict()}")
            out._add(stats, amax, tokens)
        return out

    def plans(self, num_channels_for) -> dict[str, RACPlan]:
        """num_channels_for(K) -> channel count (e.g. RACConfig.num_channels)."""
        return {
            name: RACPlan.from_scores(s, num_channels_for(s.numel() * BLOCK_SIZE)) for name, s in self.stats.items()
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{k}.{self.metric}": v for k, v in self.stats.items()}


def save_rac_plans(path: str, plans: dict[str, RACPlan]) -> None:
    """Plans as int64 block indices in safetensors (``quads convert --rac-plans``). Name the GEMMs
    like the serving engine's MoE layers: ``<moe prefix>.w13`` (fc1) and ``<moe prefix>.w2`` (fc2),
    e.g. ``model.layers.0.mlp.experts.w13``."""
    from safetensors.torch import save_file

    save_file({name: p.blocks.to(torch.int64).contiguous() for name, p in plans.items()}, path)


def save_calibration(out_dir: str, cal: RACCalibrator, num_channels_for, num_experts: int) -> dict[str, str]:
    """Write what ``quads convert`` takes from a calibration whose layers are named ``<moe prefix>.w13``
    (fc1 input) and ``<moe prefix>.w2`` (fc2 input), both for every MoE layer:

    * ``rac_plans.safetensors`` (``--rac-plans``): plans of num_channels_for(K) channels;
    * ``input_amax.json`` (``--input-amax``): each expert's gate_proj / up_proj get the layer's fc1
      max |x|, its down_proj the fc2 one (ModelOpt keeps one ``input_scale`` per module; serving
      engines take the max over a layer's experts);
    * ``calibration_stats.safetensors``: the raw block scores, with amax and row counts in its metadata.

    Each file is written under a temporary name (``.tmp``) and then renamed: an interrupted run leaves no
    partial file under the final names.
    Returns {"rac_plans": path, "input_amax": path, "stats": path}."""
    import json
    import os

    from safetensors.torch import save_file

    prefixes: dict[str, set[str]] = {}
    for name in cal.stats:
        prefix, _, gemm = name.rpartition(".")
        if gemm not in ("w13", "w2") or not prefix:
            raise RACPlanError(f"calibration layer {name!r} is not named <moe prefix>.w13 or <moe prefix>.w2")
        prefixes.setdefault(prefix, set()).add(gemm)
    incomplete = sorted(p for p, g in prefixes.items() if g != {"w13", "w2"})
    if not prefixes or incomplete:
        raise RACPlanError(f"calibration needs both w13 and w2 of every MoE layer; incomplete: {incomplete[:4]}")
    amax: dict[str, float] = {}
    for prefix in sorted(prefixes):
        for e in range(num_experts):
            amax[f"{prefix}.{e}.gate_proj"] = amax[f"{prefix}.{e}.up_proj"] = cal.amax[f"{prefix}.w13"]
            amax[f"{prefix}.{e}.down_proj"] = cal.amax[f"{prefix}.w2"]
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        k: os.path.join(out_dir, f)
        for k, f in (
            ("rac_plans", "rac_plans.safetensors"),
            ("input_amax", "input_amax.json"),
            ("stats", "calibration_stats.safetensors"),
        )
    }
    tmp = {k: p + ".tmp" for k, p in paths.items()}
    save_rac_plans(tmp["rac_plans"], cal.plans(num_channels_for))
    with open(tmp["input_amax"], "w") as f:
        json.dump(amax, f, indent=1, sort_keys=True)
    meta = {"metric": cal.metric, "amax": json.dumps(cal.amax), "tokens": json.dumps(cal.tokens)}
    meta["recipe"] = json.dumps(cal.recipe.to_dict())
    save_file({k: v.contiguous() for k, v in cal.stats.items()}, tmp["stats"], metadata=meta)
    for k in paths:
        os.replace(tmp[k], paths[k])
    return paths
