"""Serving a quads_nvfp4 FusedMoE layer's expert weights in the tiled layout (kernels.weight_layout).

The four parameters w13_weight, w13_weight_scale, w2_weight, w2_weight_scale keep their row-major shapes
([E, N, K/2] / [E, N, K/16]) and storage; once loaded, each expert's slab is permuted in place into the
tiled order (set_tiled), which the grouped GEMMs read 5-8% faster from 64 tokens up. Every write must still
land row-major, so:

* SGLang's own loader (initial load, update_weights_from_disk / _from_tensor / _from_distributed with its
  default format): every per-expert write of FusedMoE.weight_loader goes through the layer's
  ``_weight_loader_impl(param, loaded_weight, weight_name, shard_id, expert_id)`` with the local expert id
  (0.5.17 and 0.5.23 alike); guard_loader wraps it on the layer to untile that expert's slab of that
  parameter, write, and tile it again (about 3x the slab's bytes per write).
* quads_nvfp4's live-sync loader untiles every layer it writes once (row_major) and tiles it again after,
  even when the write fails.
* Moving whole expert slabs (EPLB rebalancing) keeps the layout: each slab is tiled on its own.
Not covered: load_format="direct" (SGLang copies whole parameters with no loader: the bytes must already be
tiled) and get_weights_by_name (returns the tiled bytes).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator

import torch

from quads_megatron.kernels.weight_layout import (
    CHUNK_K,
    CODE_CHUNK_BYTES,
    SCALE_CHUNK_BYTES,
    retile_,
    scratch_bytes,
)

#: the tiled parameters and the bytes of one row's 128-K chunk in each
PARAMS = (
    ("w13_weight", CODE_CHUNK_BYTES),
    ("w13_weight_scale", SCALE_CHUNK_BYTES),
    ("w2_weight", CODE_CHUNK_BYTES),
    ("w2_weight_scale", SCALE_CHUNK_BYTES),
)
SCRATCH_MAX_BYTES = 64 << 20  # the most scratch set_tiled allocates (whole expert slabs, at least one)
_FLAG = "_quads_tiled"
_LOADER_ARGS = ("param", "loaded_weight", "weight_name", "shard_id", "expert_id")


def tileable(hidden: int, inter: int) -> str | None:
    """Why a layer of this hidden size and intermediate size per partition cannot be tiled, else None."""
    if hidden % CHUNK_K or inter % CHUNK_K:  # K of both GEMMs in whole chunks (then N in whole row groups too)
        return f"hidden {hidden} and intermediate per partition {inter} must be multiples of {CHUNK_K}"
    return None


def loader_hook_missing(layer: torch.nn.Module) -> str | None:
    """Why guard_loader cannot wrap this FusedMoE's per-expert writes (an SGLang without the hook), else None."""
    impl = getattr(layer, "_weight_loader_impl", None)
    if impl is None:
        return "this SGLang's FusedMoE has no _weight_loader_impl"
    try:
        names = tuple(inspect.signature(impl).parameters)
    except (TypeError, ValueError):
        return "FusedMoE._weight_loader_impl has no readable signature"
    if names != _LOADER_ARGS:
        return f"FusedMoE._weight_loader_impl takes {names}, expected {_LOADER_ARGS}"
    return None


def is_tiled(layer: torch.nn.Module) -> bool:
    return bool(getattr(layer, _FLAG, False))


def _params(layer: torch.nn.Module) -> list[tuple[torch.Tensor, int]]:
    return [(getattr(layer, name).data, chunk) for name, chunk in PARAMS]


def set_tiled(layer: torch.nn.Module, tiled: bool) -> None:
    """Permute every expert slab of the layer's four parameters in place into (True) or out of (False) the
    tiled order; nothing to do when the layer already is so. The scratch is allocated before the first write,
    so a failed allocation leaves the layer as it was."""
    if is_tiled(layer) == tiled:
        return
    params = _params(layer)
    scratch = torch.empty(
        max(scratch_bytes(p, SCRATCH_MAX_BYTES) for p, _ in params), dtype=torch.uint8, device=params[0][0].device
    )
    for p, chunk in params:
        retile_(p, chunk, tiled=tiled, scratch=scratch)
    setattr(layer, _FLAG, tiled)


@contextlib.contextmanager
def row_major(layers: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Within the block the given layers hold row-major bytes (loaders write them); on exit, the ones that
    were tiled are tiled again, whether the block raised or not."""
    untiled = []
    try:
        for layer in layers:
            if is_tiled(layer):
                set_tiled(layer, False)
                untiled.append(layer)
        yield
    finally:
        for layer in untiled:
            set_tiled(layer, True)


def guard_loader(layer: torch.nn.Module) -> None:
    """Wrap the layer's FusedMoE._weight_loader_impl so that a write into a tiled parameter meets row-major
    bytes: that expert's slab is untiled, written, and tiled again (also when the write raises). Writes into
    other parameters, or while the layer is row-major, pass through. An expert id that is not a local slot
    untiles the whole parameter."""
    impl: Callable[..., None] = layer._weight_loader_impl
    chunks = {name: chunk for name, chunk in PARAMS}

    def write(param, loaded_weight, weight_name, shard_id, expert_id):
        args = {"param": param, "loaded_weight": loaded_weight, "weight_name": weight_name, "shard_id": shard_id}
        name = next((n for n in chunks if getattr(layer, n, None) is param), None)
        if name is None or not is_tiled(layer):
            return impl(**args, expert_id=expert_id)
        data, chunk = param.data, chunks[name]
        local = isinstance(expert_id, int) and not isinstance(expert_id, bool) and 0 <= expert_id < data.shape[0]
        first, count = (expert_id, 1) if local else (0, data.shape[0])
        scratch = torch.empty(
            scratch_bytes(data[first : first + count], SCRATCH_MAX_BYTES), dtype=torch.uint8, device=data.device
        )
        retile_(data, chunk, tiled=False, first=first, count=count, scratch=scratch)
        try:
            return impl(**args, expert_id=expert_id)
        finally:
            retile_(data, chunk, tiled=True, first=first, count=count, scratch=scratch)

    layer._weight_loader_impl = write
