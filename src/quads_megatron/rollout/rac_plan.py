"""RAC selections, shared by the torch reference and the kernels: static plans and their rules.

A static plan lists the compensated 16-channel blocks of K for one GEMM (calibrated per layer); a
dynamic selection compensates each token's top blocks by residual amax (reference.dynamic_block_mask).
QuantizedActivation is what either path hands to a W4A4 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quads_megatron.errors import RACPlanError
from quads_megatron.nvfp4 import BLOCK_SIZE, NVFP4Tensor


@dataclass(frozen=True)
class RACPlan:
    """Static RAC selection of one GEMM: sorted indices of compensated 16-channel blocks of K."""

    blocks: torch.Tensor  # int64 [n_sel], sorted, each in [0, K/16)
    k: int

    def __post_init__(self) -> None:
        b = self.blocks
        if b.dim() != 1 or (b.numel() and (int(b.min()) < 0 or int(b.max()) >= self.k // BLOCK_SIZE)):
            raise RACPlanError(f"RAC plan blocks must be 1-D indices in [0, {self.k // BLOCK_SIZE})")
        if b.numel() != torch.unique(b).numel():
            raise RACPlanError("RAC plan blocks must be unique")

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
            raise RACPlanError(f"RAC channel count {num_channels} is not a multiple of {BLOCK_SIZE}")
        n = num_channels // BLOCK_SIZE
        top = torch.topk(scores.float(), n, largest=True, sorted=False).indices if n else scores.new_zeros(0).long()
        return cls(torch.sort(top.long().cpu()).values, scores.numel() * BLOCK_SIZE)


@dataclass(frozen=True)
class QuantizedActivation:
    """x [M, K] quantized for W4A4: x codes/scales, optional dense residual, per-row S_dec [M, 1]."""

    x: NVFP4Tensor
    residual: NVFP4Tensor | None  # same global_decode as x; zero codes and scales off the selection


def check_rac_selection(k: int, plan: RACPlan | None = None, dynamic_channels: int = 0) -> None:
    """Refuse a RAC selection that cannot apply to activations of inner size k (reference, kernels
    and RAC configs share these rules and messages)."""
    if plan is not None and dynamic_channels:
        raise RACPlanError("use either a static RAC plan or dynamic_channels, not both")
    if plan is not None and plan.k != k:
        raise RACPlanError(f"RAC plan is for K={plan.k}, activation has K={k}")
    if dynamic_channels % BLOCK_SIZE:
        raise RACPlanError(f"dynamic RAC channels {dynamic_channels} is not a multiple of {BLOCK_SIZE}")
