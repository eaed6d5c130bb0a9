"""Live weight sync: Megatron expert parameters -> the HF-named NVFP4 tensors a rollout engine loads.

megatron_expert_tensors() turns Megatron expert params (SequentialMLP or TEGroupedMLP names, any EP
rank) into the same tensors ``quads convert`` writes; gather_expert_tp() joins expert-TP shards first;
bucketed() groups them for ``update_weights_from_tensor``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from quads_megatron import nvfp4
from quads_megatron.checkpoint.modelopt import modelopt_tensors, quantize_linear
from quads_megatron.config import NVFP4Config
from quads_megatron.errors import ConvertError

_MCORE_SEQ = re.compile(
    r"^(?P<pre>.*?)layers\.(?P<layer>\d+)\.mlp\.experts\.local_experts\.(?P<i>\d+)\.linear_(?P<fc>fc1|fc2)\.weight$"
)
_MCORE_TE = re.compile(r"^(?P<pre>.*?)layers\.(?P<layer>\d+)\.mlp\.experts\.linear_(?P<fc>fc1|fc2)\.weight(?P<i>\d+)$")


def megatron_expert_tensors(
    named_params: Iterable[tuple[str, torch.Tensor]],
    ep_rank: int = 0,
    num_local_experts: int | None = None,
    hf_prefix: str = "model.layers",
    layer_offset: int = 0,
    input_amax: dict[str, float] | None = None,
    nvfp4_config: NVFP4Config | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron routed-expert params of one EP rank -> HF-named NVFP4 ModelOpt tensors.

    fc1 [2F, H] (gate | up, GLU) is quantized as one tensor (its amax is the shared gate/up
    amax) and split by rows into gate_proj / up_proj; fc2 -> down_proj. Global expert index =
    ep_rank * num_local_experts + local index. Non-expert params are skipped (send them as BF16).
    With expert TP > 1, pass the params through gather_expert_tp first (full [2F, H] / [H, F]).
    nvfp4_config: the variant (the QUADS config's nvfp4 section, as the trainer's fake-quant uses it):
    weights quantized with its weight recipe, input_scale of input_amax with its activation recipe.
    """
    input_amax = input_amax or {}
    cfg = nvfp4_config or NVFP4Config()
    for name, w in named_params:
        m = _MCORE_SEQ.match(name) or _MCORE_TE.match(name)
        if m is None:
            continue
        if num_local_experts is None:
            raise ConvertError("num_local_experts is required to map local experts to global indices")
        g = ep_rank * num_local_experts + int(m["i"])
        base = f"{hf_prefix}.{int(m['layer']) + layer_offset}.mlp.experts.{g}"
        q = quantize_linear(w, name, recipe=cfg.weights)
        if m["fc"] == "fc2":
            yield from modelopt_tensors(
                f"{base}.down_proj", q, input_amax.get(f"{base}.down_proj"), cfg.activations
            ).items()
            continue
        if q.codes.shape[0] % 2:
            raise ConvertError(f"{name}: fc1 has an odd row count {q.codes.shape[0]}; expected gate|up halves")
        half = q.codes.shape[0] // 2
        for proj, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
            # own storage per tensor: receivers (and safetensors) must not see gate/up aliasing
            part = nvfp4.NVFP4Tensor(q.codes[rows].clone(), q.block_scales[rows].clone(), q.global_decode.clone())
            amax = input_amax.get(f"{base}.{proj}")
            yield from modelopt_tensors(f"{base}.{proj}", part, amax, cfg.activations).items()


def gather_expert_tp(
    named_params: Iterable[tuple[str, torch.Tensor]], group: object = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert-tensor-parallel shards -> full per-expert weights, for megatron_expert_tensors.

    Megatron's fc1 shard on ETP rank r is [gate_r; up_r] (F/ETP rows each; see megatron-core's
    apply_swiglu_sharded_factory), fc2 is columns r of [H, F]. Collective over ``group`` (the
    expert-TP group): every rank passes the same names in the same order. Other params and a
    group of one pass through unchanged.
    """
    size = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
    for name, t in named_params:
        m = _MCORE_SEQ.match(name) or _MCORE_TE.match(name)
        if m is None or size == 1:
            yield name, t
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        if m["fc"] == "fc1":
            if t.shape[0] % 2:
                raise ConvertError(f"{name}: expert-TP fc1 shard has an odd row count {t.shape[0]}")
            halves = [p.chunk(2, dim=0) for p in parts]
            yield name, torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            yield name, torch.cat(parts, dim=1)


_GATE_UP_UNIT = re.compile(r"^(?P<base>.*\.experts\.\d+)\.(?:gate_proj|up_proj|w1|w3)\.")


def bucketed(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20) -> Iterator[list]:
    """Group (name, tensor) pairs into lists of at most bucket_bytes.

    An expert's gate and up tensors (one shared global scale) always land in the same list, as
    long as they arrive consecutively (megatron_expert_tensors yields them so): a receiver can
    then check and apply each list on its own. One unit larger than bucket_bytes is a list alone.
    """
    unit: list[tuple[str, torch.Tensor]] = []
    unit_key = None
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0

    def nbytes(items):
        return sum(t.numel() * t.element_size() for _, t in items)

    for name, t in tensors:
        m = _GATE_UP_UNIT.match(name)
        key = m["base"] if m else None
        if unit and (key is None or key != unit_key):
            if bucket and size + nbytes(unit) > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket += unit
            size += nbytes(unit)
            unit = []
        unit.append((name, t))
        unit_key = key
    if unit:
        if bucket and size + nbytes(unit) > bucket_bytes:
            yield bucket
            bucket = []
        bucket += unit
    if bucket:
        yield bucket
