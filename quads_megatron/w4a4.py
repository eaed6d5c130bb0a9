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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quads_megatron import nvfp4
from quads_megatron.nvfp4 import BLOCK_SIZE, NVFP4InputError, NVFP4Tensor


@dataclass(frozen=True)
class RACPlan:
    """Static RAC selection of one GEMM: sorted indices of compensated 16-channel blocks of K."""

    blocks: torch.Tensor  # int64 [n_sel], sorted, each in [0, K/16)
    k: int

    def __post_init__(self) -> None:
        b = self.blocks
        if b.dim() != 1 or (b.numel() and (int(b.min()) < 0 or int(b.max()) >= self.k // BLOCK_SIZE)):
            raise NVFP4InputError(f"RAC plan blocks must be 1-D indices in [0, {self.k // BLOCK_SIZE})")
        if b.numel() != torch.unique(b).numel():
            raise NVFP4InputError("RAC plan blocks must be unique")

    @property
    def num_channels(self) -> int:
        return int(self.blocks.numel()) * BLOCK_SIZE

    def block_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool [K/16]: True on compensated blocks."""
        m = torch.zeros(self.k // BLOCK_SIZE, dtype=torch.bool, device=device)
        m[self.blocks.to(device)] = True
        return m

    @classmethod
    def from_scores(cls, scores: torch.Tensor, num_channels: int) -> RACPlan:
        """Top blocks by a per-block score (fp32 [K/16]); num_channels must be a multiple of 16."""
        if num_channels % BLOCK_SIZE:
            raise NVFP4InputError(f"RAC channel count {num_channels} is not a multiple of {BLOCK_SIZE}")
        n = num_channels // BLOCK_SIZE
        top = torch.topk(scores.float(), n, largest=True, sorted=False).indices if n else scores.new_zeros(0).long()
        return cls(torch.sort(top.long().cpu()).values, scores.numel() * BLOCK_SIZE)


@dataclass(frozen=True)
class QuantizedActivation:
    """x [M, K] quantized for W4A4: x codes/scales, optional dense residual, per-row S_dec [M, 1]."""

    x: NVFP4Tensor
    residual: NVFP4Tensor | None  # same global_decode as x; zero codes and scales off the selection


def activation_amax(x: torch.Tensor, static_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row global amax [M, 1]: dynamic per-token, or one calibrated static amax broadcast."""
    if static_amax is None:
        return nvfp4.amax(x, "row")
    return static_amax.detach().float().reshape(1, 1).to(x.device).expand(x.shape[0], 1)


def residual_block_scores(x: torch.Tensor, static_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token, per-block squared residual norm: fp32 [M, K/16] (the RAC error statistic)."""
    xq = nvfp4.quantize(x, "row", activation_amax(x, static_amax))
    r = x.float() - nvfp4.dequantize(xq)
    return r.reshape(x.shape[0], -1, BLOCK_SIZE).square().sum(-1)


def check_rac_selection(k: int, plan: RACPlan | None = None, dynamic_channels: int = 0) -> None:
    """Refuse a RAC selection that cannot apply to activations of inner size k (reference, kernels
    and RAC configs share these rules and messages)."""
    if plan is not None and dynamic_channels:
        raise NVFP4InputError("use either a static RAC plan or dynamic_channels, not both")
    if plan is not None and plan.k != k:
        raise NVFP4InputError(f"RAC plan is for K={plan.k}, activation has K={k}")
    if dynamic_channels % BLOCK_SIZE:
        raise NVFP4InputError(f"dynamic RAC channels {dynamic_channels} is not a multiple of {BLOCK_SIZE}")


def dynamic_block_mask(residual: torch.Tensor, channels: int) -> torch.Tensor:
    """Per-token RAC selection: bool [M, K/16] from the residual [M, K/16, 16] (fp32).

    A block is compensated when its residual amax is >= the token's n-th largest block amax
    (n = channels / 16): the top n blocks, plus any tied with the n-th. Amax (not a sum) makes the
    score order-independent, so the Triton kernel selects exactly the same blocks.
    """
    if channels % BLOCK_SIZE:
        raise NVFP4InputError(f"dynamic RAC channels {channels} is not a multiple of {BLOCK_SIZE}")
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
) -> QuantizedActivation:
    """Quantize x [M, K] for W4A4 (+RAC).

    plan: static RAC selection (calibrated per layer); dynamic_channels: instead, compensate the
    top blocks of each token by residual amax (a multiple of 16, see dynamic_block_mask).
    Neither: plain W4A4.
    """
    nvfp4.check_quantizable(x, "activation")
    if x.dim() != 2:
        raise NVFP4InputError(f"activation must be [M, K], got {tuple(x.shape)}")
    check_rac_selection(x.shape[1], plan, dynamic_channels)
    a = activation_amax(x, static_amax)
    xq = nvfp4.quantize(x, "row", a, check=False)
    if plan is None and not dynamic_channels:
        return QuantizedActivation(xq, None)
    r = (x.float() - nvfp4.dequantize(xq)).reshape(x.shape[0], -1, BLOCK_SIZE)
    if plan is not None:
        mask = plan.block_mask(x.device).expand(x.shape[0], -1)
    else:
        mask = dynamic_block_mask(r, dynamic_channels)
    r = torch.where(mask.unsqueeze(-1), r, torch.zeros_like(r)).reshape(x.shape)
    return QuantizedActivation(xq, nvfp4.quantize(r, "row", a, check=False))


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
) -> torch.Tensor:
    """MoE grouped W4A4: rows offs[e-1]:offs[e] of x [M, K] go to expert e (offs as in torch._grouped_mm)."""
    out = x.new_zeros((x.shape[0], weights[0].shape[0]), dtype=torch.float32)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            plan = plans[e] if plans is not None else None
            qa = quantize_activation(x[start:end], plan, static_amax, dynamic_channels)
            out[start:end] = w4a4_linear_reference(qa, weights[e])
        start = end
    return out


class RACCalibrator:
    """Records per-layer RAC statistics over calibration batches and turns them into plans.

    metric 'residual': squared residual norm per 16-channel block, summed over rows (the error RAC
    removes); metric 'amax': max |x| per block (ARCQuant-style outlier statistic). Either way it also
    keeps each layer's max |x| (``amax``: a static ``input_scale``'s calibration) and its row count.
    Layers are named by the caller; ``<moe prefix>.w13`` / ``.w2`` is what the converter and the SGLang
    method read (see save_calibration).
    """

    def __init__(self, metric: str = "residual") -> None:
        if metric not in ("residual", "amax"):
            raise ValueError(f"metric must be 'residual' or 'amax', got {metric!r}")
        self.metric = metric
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
            s = residual_block_scores(x2).sum(0).cpu()
        else:
            s = x2.abs().float().reshape(x2.shape[0], -1, BLOCK_SIZE).amax(dim=(0, 2)).cpu()
        self._add({layer: s}, {layer: float(x2.abs().max())}, {layer: x2.shape[0]})

    def _add(self, stats: dict[str, torch.Tensor], amax: dict[str, float], tokens: dict[str, int]) -> None:
        for name, s in stats.items():
            old = self.stats.get(name)
            if old is not None and old.shape != s.shape:
                raise NVFP4InputError(f"calibration of {name}: K/16 = {s.numel()} here, {old.numel()} before")
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
        out = RACCalibrator(self.metric)
        mine = (self.metric, self.stats, self.amax, self.tokens)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            every: list = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(every, mine, group=group)
        else:
            every = [mine]
        for metric, stats, amax, tokens in every:
            if metric != self.metric:
                raise ValueError(f"cannot merge calibrations of metric {metric!r} into {self.metric!r}")
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
            raise NVFP4InputError(f"calibration layer {name!r} is not named <moe prefix>.w13 or <moe prefix>.w2")
        prefixes.setdefault(prefix, set()).add(gemm)
    incomplete = sorted(p for p, g in prefixes.items() if g != {"w13", "w2"})
    if not prefixes or incomplete:
        raise NVFP4InputError(f"calibration needs both w13 and w2 of every MoE layer; incomplete: {incomplete[:4]}")
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
    save_file({k: v.contiguous() for k, v in cal.stats.items()}, tmp["stats"], metadata=meta)
    for k in paths:
        os.replace(tmp[k], paths[k])
    return paths
