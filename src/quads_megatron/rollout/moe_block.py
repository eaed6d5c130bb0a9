"""Rollout MoE block: routed tokens through W4A4 NVFP4 experts with RAC (what the SGLang backend runs).

y[t] = sum_j  w[t, j] * fc2_e( act( fc1_e(x[t]) ) ),  e = ids[t, j]

fc1/fc2 are W4A4 GEMMs (quads_megatron.w4a4): activations quantized per token (or with a static
amax), optionally RAC-compensated (static plan or dynamic per-token selection), weights are the
converter's / trainer's NVFP4 codes as they are (no re-quantization). fc1 outputs and the gated
activation are rounded to the activation dtype (bf16) like every serving engine does between the
two GEMMs. Two implementations with one contract: ``reference`` (torch, any device) and
``triton`` (quads_megatron.kernels, the Hopper path). The Triton path fuses SiLU(gate)
* up into fc2's activation quantization; on a GPU that SiLU uses Triton's exp, so a few gated
values may differ from torch's SiLU by one bf16 ulp (bit-identical under the CPU interpreter).

Routing: ids outside [0, E) (tokens routed to experts of another EP rank, marked -1 by SGLang)
contribute nothing. The top-k sum runs in a fixed order (no atomics): same input, same bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from quads_megatron.kernels import weight_layout
from quads_megatron.nvfp4 import BLOCK_SIZE, NVFP4Recipe, NVFP4Tensor
from quads_megatron.rollout import rac_plan, reference

ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class ExpertWeights:
    """NVFP4 weights of one MoE layer's local experts, stacked as the kernels read them.

    w13_codes u8 [E, 2I, H/2] (gate rows, then up rows), w13_scales u8 [E, 2I, H/16] (E4M3 bytes),
    w13_sdec f32 [E] (S_dec, shared by gate and up); w2_codes u8 [E, H, I/2], w2_scales u8
    [E, H, I/16], w2_sdec f32 [E]. Views of the serving engine's parameters are fine (no copies). Codes and
    scales may instead be in weight_layout's tiled order (tile_weights; both GEMMs' alike), which every
    kernel path reads; expert() then returns a row-major copy.
    """

    w13_codes: torch.Tensor
    w13_scales: torch.Tensor
    w13_sdec: torch.Tensor
    w2_codes: torch.Tensor
    w2_scales: torch.Tensor
    w2_sdec: torch.Tensor

    def __post_init__(self) -> None:
        try:
            e, two_i, h, t13 = weight_layout.weight_dims(self.w13_codes, self.w13_scales)
            e2, h2, i, t2 = weight_layout.weight_dims(self.w2_codes, self.w2_scales)
        except ValueError as err:
            raise ValueError(f"expert weights: {err}") from err
        if t13 != t2:
            raise ValueError("expert weights: w13 and w2 must be in the same layout (both row-major or both tiled)")
        if two_i % 2 or (e2, h2, i) != (e, h, two_i // 2):
            raise ValueError(
                f"expert weights: w13 codes {tuple(self.w13_codes.shape)} and w2 codes "
                f"{tuple(self.w2_codes.shape)} are not [E, 2I, H/2] and [E, H, I/2]"
            )
        checks = [("w13_sdec", self.w13_sdec, (e,)), ("w2_sdec", self.w2_sdec, (e,))]
        if not t13:
            checks += [("w13_scales", self.w13_scales, (e, two_i, h // BLOCK_SIZE))]
            checks += [("w2_scales", self.w2_scales, (e, h, i // BLOCK_SIZE))]
        for name, t, want in checks:
            if tuple(t.shape) != want:
                raise ValueError(f"expert weights: {name} has shape {tuple(t.shape)}, expected {want}")
        object.__setattr__(self, "_dims", (e, h, i, t13))  # (E, H, I, tiled)

    @property
    def num_experts(self) -> int:
        return self._dims[0]

    @property
    def hidden(self) -> int:
        return self._dims[1]

    @property
    def intermediate(self) -> int:
        return self._dims[2]

    @property
    def tiled(self) -> bool:
        return self._dims[3]

    def as_tiled(self) -> ExpertWeights:
        """The same weights in weight_layout's tiled order (new tensors; self if already tiled)."""
        if self.tiled:
            return self
        w13 = weight_layout.tile_weights(self.w13_codes, self.w13_scales)
        w2 = weight_layout.tile_weights(self.w2_codes, self.w2_scales)
        return ExpertWeights(*w13, self.w13_sdec, *w2, self.w2_sdec)

    def as_row_major(self) -> ExpertWeights:
        """The same weights row-major (new tensors; self if already row-major)."""
        if not self.tiled:
            return self
        w13 = weight_layout.untile_weights(self.w13_codes, self.w13_scales)
        w2 = weight_layout.untile_weights(self.w2_codes, self.w2_scales)
        return ExpertWeights(*w13, self.w13_sdec, *w2, self.w2_sdec)

    def expert(self, e: int, which: str) -> NVFP4Tensor:
        """Expert e's 'w13' [2I, H] or 'w2' [H, I] as an NVFP4Tensor (views; copies of tiled weights)."""
        codes, scales, sdec = (
            (self.w13_codes, self.w13_scales, self.w13_sdec)
            if which == "w13"
            else (self.w2_codes, self.w2_scales, self.w2_sdec)
        )
        row = e
        if self.tiled:  # this expert's slab alone, row-major
            (codes, scales), row = weight_layout.untile_weights(codes[e : e + 1], scales[e : e + 1]), 0
        return NVFP4Tensor(codes[row], scales[row].view(torch.float8_e4m3fn), sdec[e].reshape(()))


@dataclass(frozen=True)
class GemmRAC:
    """RAC of one GEMM: a static plan (calibrated), or dynamic per-token channels, or neither."""

    plan: rac_plan.RACPlan | None = None
    dynamic_channels: int = 0
    mask: torch.Tensor | None = None  # the plan's int8 [K/16] block mask on the compute device

    def on(self, device: torch.device | str) -> GemmRAC:
        """The same selection with its mask already on device (no host copy per call: CUDA-graph safe)."""
        if self.plan is None:
            return self
        return GemmRAC(self.plan, 0, self.plan.block_mask(device).to(torch.int8))

    def __post_init__(self) -> None:
        rac_plan.check_rac_selection(self.plan.k if self.plan is not None else 0, self.plan, self.dynamic_channels)


@dataclass(frozen=True)
class LayerRAC:
    fc1: GemmRAC = GemmRAC()
    fc2: GemmRAC = GemmRAC()

    def on(self, device: torch.device | str) -> LayerRAC:
        return LayerRAC(self.fc1.on(device), self.fc2.on(device))


def route(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group (token, slot) pairs by expert, without a host sync.

    Returns order int64 [T*k] (flat slot index of each grouped row; pairs with foreign experts
    last), offs int32 [E] (cumulative row ends, as torch._grouped_mm), valid bool [T*k] (grouped
    rows that belong to a local expert).
    """
    ids = topk_ids.reshape(-1).long()
    local = (ids >= 0) & (ids < num_experts)
    key = torch.where(local, ids, torch.full_like(ids, num_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]  # bincount would sync
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return order, offs, local[order]


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported (supported: {list(ACTIVATIONS)})")


def gated_activation(y1: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[M, 2I] (gate | up) -> act(gate) * up [M, I], computed in fp32, rounded to y1's dtype."""
    check_activation(activation)
    gate, up = y1.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(y1.dtype)


def combine(
    y_grouped: torch.Tensor, order: torch.Tensor, valid: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Grouped expert outputs [T*k, H] -> sum_j w[t, j] * y[t, j] in fp32 [T, H], in slot order."""
    t, k = topk_weights.shape
    y = torch.zeros((t * k, y_grouped.shape[1]), dtype=torch.float32, device=y_grouped.device)
    y[order] = torch.where(valid[:, None], y_grouped.float(), 0.0)
    return (y.view(t, k, -1) * topk_weights.float().unsqueeze(-1)).sum(1)


def moe_w4a4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights,
    rac: LayerRAC = LayerRAC(),
    static_amax: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    activation: str = "silu",
    impl: str = "auto",
    check: bool = True,
    recipe: NVFP4Recipe | None = None,
) -> torch.Tensor:
    """MoE experts of x [T, H] (bf16/fp16) with topk_ids/topk_weights [T, k] -> [T, H] in x.dtype.

    impl: 'reference' (torch), 'triton' (Triton kernels; CPU only under TRITON_INTERPRET=1), 'wgmma'
    (the expert GEMMs on the Gluon Hopper kernel instead: sm_90, K % 128 == 0, K >= 256, N % 64 == 0), 'mma'
    (on the decode-size Gluon kernel: sm_89+, K % 128 == 0, N % 64 == 0), or 'auto' (on CUDA the GEMM
    gemm_impl picks for this many rows, reference elsewhere). check: refuse NaN/Inf in x (a host sync; pass
    False inside CUDA-graph capture). Nothing else syncs with the host on the kernel paths. recipe: the
    activations' NVFP4 variant (None: plain NVFP4; the weights carry theirs in their codes and scales).
    """
    if x.dim() != 2 or x.shape[1] != weights.hidden:
        raise ValueError(f"hidden states must be [T, {weights.hidden}], got {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} must both be [T={x.shape[0]}, k]"
        )
    if impl == "auto":
        impl = gemm_impl(x.device, weights, topk_ids.numel()) if x.is_cuda else "reference"
    if impl not in ("reference", "triton", "wgmma", "mma"):
        raise ValueError(f"impl must be 'auto', 'reference', 'triton', 'wgmma' or 'mma', got {impl!r}")
    if impl == "wgmma" and not hopper_gemm_usable(x.device, weights):
        raise ValueError(
            "impl='wgmma' needs an sm_90 GPU, H and I multiples of 128 and >= 256, and a Triton with Gluon"
        )
    if impl == "mma" and not mma_gemm_usable(x.device, weights):
        raise ValueError("impl='mma' needs a CUDA GPU (sm_89+), H and I multiples of 128, and a Triton with Gluon")
    check_activation(activation)  # before any work, on both paths
    if x.shape[0] == 0:  # idle batch (e.g. data-parallel attention ranks without tokens)
        return torch.empty_like(x)
    if impl == "reference":
        order, offs, valid = route(topk_ids, weights.num_experts)
        tokens = order // topk_ids.shape[1]
        y2 = _experts_reference(x, tokens, offs, valid, weights, rac, static_amax, activation, recipe)
        return combine(y2, order, valid, topk_weights).to(x.dtype)
    from quads_megatron.kernels import combine as combine_kernel
    from quads_megatron.kernels import route as route_kernel
    from quads_megatron.kernels import route_chunked

    path = routing_path(topk_ids.numel())
    routing = None  # 'fused': routed by extra programs of fc1's quantization launch (kernels/route.py)
    if path == "torch":
        order, offs, valid = route(topk_ids, weights.num_experts)
        routing = route_kernel.Routing(order, offs, valid, order // topk_ids.shape[1], None)
    elif path == "chunked":
        routing = route_chunked.route_chunked(topk_ids, weights.num_experts)
    elif path == "kernel":
        routing = route_kernel.route(topk_ids, weights.num_experts)
    y2, routing = _experts_triton(x, topk_ids, routing, weights, rac, static_amax, activation, check, impl, recipe)
    return combine_kernel.combine(y2, routing.order, topk_ids, topk_weights, weights.num_experts, x.dtype, routing.pos)


FUSED_ROUTING_MAX_ROWS = 512  # H100 2026-12-07: fused 2.2 / 1.0 us faster at 128 / 512 rows, 5.4 us slower at 2048
#: the most rows routed by the one-launch kernel unless forced (above: the chunked routing's two launches;
#: H200 2026-12-07: one launch 4.0 / 6.7 / 12.4 us at 2048 / 4096 / 8192 rows, chunked 4.4 / 4.5 / 4.9 us)
KERNEL_ROUTING_MAX_ROWS = 2048
ROUTING_PATHS = ("fused", "kernel", "chunked", "torch")


def routing_fits(path: str, rows: int) -> bool:
    """Whether routing path (of ROUTING_PATHS) routes T*k = rows: the one-launch paths up to ROUTE_MAX_ROWS."""
    from quads_megatron.kernels.route import ROUTE_MAX_ROWS

    return path not in ("fused", "kernel") or rows <= ROUTE_MAX_ROWS


def routing_path(rows: int) -> str:
    """How the kernel paths route T*k rows: 'fused' (extra programs of fc1's quantization launch, up to
    FUSED_ROUTING_MAX_ROWS, where it was timed faster), 'kernel' (kernels/route.py's one launch, up to
    KERNEL_ROUTING_MAX_ROWS), else 'chunked' (kernels/route_chunked.py's two launches, any size). QUADS_ROUTING
    forces one of ROUTING_PATHS ('torch': this module's route; the A/B arms); the same bits on every path."""
    from quads_megatron.kernels.route import ROUTE_MAX_ROWS

    forced = os.environ.get("QUADS_ROUTING", "")
    if forced and forced not in ROUTING_PATHS:
        raise ValueError(f"QUADS_ROUTING must be one of {', '.join(ROUTING_PATHS)} (or unset), got {forced!r}")
    if forced and not routing_fits(forced, rows):
        raise ValueError(f"QUADS_ROUTING={forced} routes at most ROUTE_MAX_ROWS={ROUTE_MAX_ROWS} pairs, got {rows}")
    if forced:
        return forced
    if rows <= FUSED_ROUTING_MAX_ROWS:
        return "fused"
    return "kernel" if rows <= KERNEL_ROUTING_MAX_ROWS else "chunked"


def _experts_reference(x, tokens, offs, valid, weights, rac, static_amax, activation, recipe):
    e = weights.num_experts

    def gemm(a, which, g, amax):
        ws = [weights.expert(i, which) for i in range(e)]
        plans = None if g.plan is None else [g.plan] * e
        return reference.grouped_w4a4_reference(a, offs, ws, plans, amax, g.dynamic_channels, recipe).to(x.dtype)

    y1 = gemm(x[tokens], "w13", rac.fc1, static_amax[0])
    h = torch.where(valid[:, None], gated_activation(y1, activation), 0.0)
    return gemm(h, "w2", rac.fc2, static_amax[1])


def hopper_gemm_usable(device: torch.device, weights: ExpertWeights, rows: int | None = None) -> bool:
    """Whether both expert GEMMs can run on the Gluon Hopper kernel (kernels/gemm_wgmma_launch.py) here;
    with rows (tokens * top-k), also whether it is the faster GEMM there (tile_configs.wgmma_faster_than_triton)."""
    if device.type != "cuda":
        return False
    try:
        from quads_megatron.kernels import gemm_wgmma_launch
    except ImportError:  # a Triton without Gluon's Hopper API
        return False
    from quads_megatron.kernels.tile_configs import wgmma_faster_than_triton

    h, i = weights.hidden, weights.intermediate
    usable = gemm_wgmma_launch.usable(device, 2 * i, h) and gemm_wgmma_launch.usable(device, h, i)
    return usable and (rows is None or wgmma_faster_than_triton(rows, device))


def mma_gemm_usable(device: torch.device, weights: ExpertWeights, rows: int | None = None) -> bool:
    """Whether both expert GEMMs can run on the decode-size Gluon kernel (kernels/gemm_mma_launch.py) here;
    with rows (tokens * top-k), also whether impl='auto' takes it there (tile_configs.mma_used)."""
    if device.type != "cuda":
        return False
    try:
        from quads_megatron.kernels import gemm_mma_launch
    except ImportError:  # a Triton without Gluon
        return False
    from quads_megatron.kernels.tile_configs import mma_used

    h, i = weights.hidden, weights.intermediate
    usable = gemm_mma_launch.usable(device, 2 * i, h) and gemm_mma_launch.usable(device, h, i)
    return usable and (rows is None or mma_used(rows, device))


def gemm_impl(device: torch.device, weights: ExpertWeights, rows: int, mma: bool = True) -> str:
    """The expert GEMMs impl='auto' runs on a GPU at this many grouped rows: 'mma' (decode sizes, where
    tuned), 'wgmma' (where it is the faster one), else 'triton'. mma=False: the choice without the
    decode-size GEMM (a benchmark's A/B)."""
    if mma and mma_gemm_usable(device, weights, rows):
        return "mma"
    return "wgmma" if hopper_gemm_usable(device, weights, rows) else "triton"


def _gemm_config(rows: int, n: int, k: int, gemm: str, out_dtype: torch.dtype, device: torch.device):
    """The tuned tiles of an expert GEMM ('triton', 'wgmma', 'mma') at this many grouped rows: (config,
    row-tile height)."""
    from quads_megatron.kernels import tile_configs

    if gemm == "wgmma":
        cfg = tile_configs.wgmma_config(rows, n, out_dtype, device, k=k)
        return cfg, cfg.block_t
    if gemm == "mma":
        from quads_megatron.kernels.gemm_mma_launch import fit_rows

        cfg = fit_rows(tile_configs.mma_config(rows, k, device), n)  # CTA rows that divide N
        return cfg, cfg.block_t
    cfg = tile_configs.triton_gemm_config(rows, k, device)
    return cfg, cfg.block_m


def _expert_gemm(op, offs, codes, scales, sdec, out_dtype, config, a_rows=None, tiles=None):
    from quads_megatron.kernels.tile_configs import MmaConfig

    if op.order == "wgmma":
        from quads_megatron.kernels import gemm_wgmma_launch

        return gemm_wgmma_launch.grouped_w4a4_wgmma(
            op.values, op.global_decode, offs, codes, scales, sdec, out_dtype, a_rows, config, tiles
        )
    if isinstance(config, MmaConfig):
        from quads_megatron.kernels import gemm_mma_launch

        return gemm_mma_launch.grouped_w4a4_mma(
            op.values, op.global_decode, offs, codes, scales, sdec, out_dtype, a_rows, config, tiles
        )
    from quads_megatron.kernels import gemm_triton

    return gemm_triton.grouped_w4a4(
        op, offs, codes, scales, sdec, out_dtype=out_dtype, config=config, a_rows=a_rows, tiles=tiles
    )


def _gemm_operand(a, g: GemmRAC, amax, order: str, recipe, **kw):
    """The activation operand of one expert GEMM (act_quant.activation_operand) with g's RAC selection."""
    from quads_megatron.kernels import act_quant

    return act_quant.activation_operand(
        a, g.plan, amax, block_mask=g.mask, dynamic_channels=g.dynamic_channels, order=order, recipe=recipe, **kw
    )


def _experts_triton(x, topk_ids, routing, weights, rac, static_amax, activation, check, gemm, recipe):
    """fc1 reads the per-token operand through the grouped rows' token index (no gathered copy);
    SiLU(gate) * up and the foreign-row mask are fused into fc2's activation quantization. fc1's
    quantization launch also writes the GEMMs' row-tile table, shared by fc2 where its tiles are as
    tall (no launch of its own), and, where routing is None, routes topk_ids itself (kernels/route.py:
    routing and fc1's quantization do not depend on each other). gemm: 'triton', 'mma' (both read the
    "pairs" operand) or 'wgmma' (operands in the Gluon Hopper kernel's order). -> (fc2's output, the
    routing)."""
    g1, g2 = rac.fc1, rac.fc2
    order = "wgmma" if gemm == "wgmma" else "pairs"
    rows, h, i = topk_ids.numel(), weights.hidden, weights.intermediate
    cfg1, bt1 = _gemm_config(rows, 2 * i, h, gemm, x.dtype, x.device)
    cfg2, bt2 = _gemm_config(rows, h, i, gemm, x.dtype, x.device)

    if routing is None:
        route_args = (topk_ids, weights.num_experts, bt1)
        op = _gemm_operand(x, g1, static_amax[0], order, recipe, check=check, route=route_args)
        routing = op.routing
    else:
        op = _gemm_operand(x, g1, static_amax[0], order, recipe, check=check, row_tiles=(routing.offs, bt1, rows))
    tokens, offs, valid = routing.tokens, routing.offs, routing.valid
    w13 = (weights.w13_codes, weights.w13_scales, weights.w13_sdec)
    y1 = _expert_gemm(op, offs, *w13, x.dtype, cfg1, a_rows=tokens, tiles=op.tiles)
    # of gated_activation(y1), zero on foreign rows; finite by construction
    row_tiles2 = None if bt2 == bt1 else (offs, bt2, rows)
    op2 = _gemm_operand(
        y1, g2, static_amax[1], order, recipe, check=False, gated=True, row_valid=valid, row_tiles=row_tiles2
    )
    tiles2 = op.tiles if bt2 == bt1 else op2.tiles
    w2 = (weights.w2_codes, weights.w2_scales, weights.w2_sdec)
    return _expert_gemm(op2, offs, *w2, x.dtype, cfg2, tiles=tiles2), routing
