"""Live weight sync: Megatron expert parameters -> the HF-named NVFP4 tensors a rollout engine loads.

megatron_expert_tensors() turns Megatron expert params (SequentialMLP or TEGroupedMLP names, any EP
rank) into the same tensors ``quads convert`` writes; gather_expert_tp() joins expert-TP shards first;
bucketed() groups them for ``update_weights_from_tensor``; flat_buckets() sends each group as one tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator

import torch

from quads_megatron import nvfp4
from quads_megatron.checkpoint.modelopt import check_weight, modelopt_tensors
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
    Consecutive experts of one layer's fc1 (or fc2) are quantized together (nvfp4.quantize_each, the
    same bits as one by one); every yielded tensor has its own storage.
    """
    input_amax = input_amax or {}
    cfg = nvfp4_config or NVFP4Config()
    run: list[tuple[str, re.Match, torch.Tensor]] = []
    for name, w in named_params:
        m = _MCORE_SEQ.match(name) or _MCORE_TE.match(name)
        if m is None:
            continue
        if num_local_experts is None:
            raise ConvertError("num_local_experts is required to map local experts to global indices")
        if run and not _same_run(run, m, w):
            yield from _expert_run_tensors(run, ep_rank, num_local_experts, hf_prefix, layer_offset, input_amax, cfg)
            run = []
        run.append((name, m, w))
    if run:
        yield from _expert_run_tensors(run, ep_rank, num_local_experts, hf_prefix, layer_offset, input_amax, cfg)


RUN_BYTES = 128 << 20  # fp32 bytes of one batched quantization (a run of experts is cut into such batches)


def _same_run(run: list, m: re.Match, w: torch.Tensor) -> bool:
    """Whether w (matched by m) joins the run: same layer and fc, same shape, dtype and device, and the
    batch stays under RUN_BYTES of fp32."""
    _, m0, w0 = run[0]
    same = (m["pre"], m["layer"], m["fc"]) == (m0["pre"], m0["layer"], m0["fc"])
    same = same and w.shape == w0.shape and w.dtype == w0.dtype and w.device == w0.device
    return same and (len(run) + 1) * w.numel() * 4 <= RUN_BYTES


def _expert_run_tensors(run, ep_rank, num_local_experts, hf_prefix, layer_offset, input_amax, cfg):
    """The ModelOpt tensors of a run of experts (one layer's fc1 or fc2), in the run's order."""
    stacked = torch.stack([w.detach() for _, _, w in run])
    try:
        check_weight(stacked[0], run[0][0])  # 2-D and K % 16; finiteness of all below, in one sync
        finite = bool(torch.isfinite(stacked).all())
    except ConvertError:
        finite = False
    if not finite:
        for name, _, w in run:  # the first bad one, named
            check_weight(w, name)
    qs = nvfp4.quantize_each(stacked, recipe=cfg.weights)
    for (name, m, _), q in zip(run, qs, strict=True):
        g = ep_rank * num_local_experts + int(m["i"])
        base = f"{hf_prefix}.{int(m['layer']) + layer_offset}.mlp.experts.{g}"
        if m["fc"] == "fc2":
            own = nvfp4.NVFP4Tensor(q.codes.clone(), q.block_scales.clone(), q.global_decode.clone())
            yield from modelopt_tensors(
                f"{base}.down_proj", own, input_amax.get(f"{base}.down_proj"), cfg.activations
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


#: A flat bucket travels as one (name, tensor) pair: the name is FLAT_PREFIX + a JSON list of
#: [name, dtype, shape, byte offset], the tensor one uint8 [bytes] buffer holding every tensor's bytes at
#: its offset (FLAT_ALIGN-aligned). One CUDA IPC handle per bucket instead of one per tensor: the engine's
#: per-tensor cost (handle, event, pickling) dominated a sync of thousands of small expert tensors.
FLAT_PREFIX = "quads_megatron.flat_bucket.v1:"
FLAT_ALIGN = 64
_FLAT_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32, torch.int32)
}


def _aligned(n: int) -> int:
    return -(-n // FLAT_ALIGN) * FLAT_ALIGN


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor]:
    """One bucket -> (FLAT_PREFIX + metadata, uint8 [bytes] on the first tensor's device); unflatten_bucket
    inverts it bit for bit."""
    if not bucket:
        raise ValueError("flatten_bucket: empty bucket")
    meta, offset = [], 0
    for name, t in bucket:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _FLAT_DTYPES:
            raise ValueError(f"flatten_bucket: {name}: dtype {t.dtype} has no flat form ({', '.join(_FLAT_DTYPES)})")
        meta.append([name, dtype, list(t.shape), offset])
        offset += _aligned(t.numel() * t.element_size())
    device = bucket[0][1].device
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, t), (_, _, _, off) in zip(bucket, meta, strict=True):
        n = t.numel() * t.element_size()
        flat[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8).to(device))
    return FLAT_PREFIX + json.dumps(meta, separators=(",", ":")), flat


def unflatten_bucket(name: str, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view into flat) of every tensor of a flat bucket; ValueError (one line) for a malformed one."""
    if not name.startswith(FLAT_PREFIX):
        raise ValueError(f"not a flat bucket name (expected the prefix {FLAT_PREFIX!r})")
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        what = f"{flat.dtype} {tuple(flat.shape)}" if isinstance(flat, torch.Tensor) else type(flat).__name__
        raise ValueError(f"flat bucket: expected a 1-D uint8 tensor, got {what}")
    try:
        meta = json.loads(name[len(FLAT_PREFIX) :])
    except ValueError as e:
        raise ValueError(f"flat bucket: unreadable metadata ({e})") from e
    if not isinstance(meta, list):
        raise ValueError("flat bucket: metadata must be a list of [name, dtype, shape, offset]")
    out = []
    for entry in meta:
        ok = isinstance(entry, list) and len(entry) == 4
        tname, dtype, shape, off = entry if ok else (None, None, None, None)
        ok = ok and isinstance(tname, str) and dtype in _FLAT_DTYPES and isinstance(off, int) and off >= 0
        ok = ok and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
        if not ok:
            raise ValueError(f"flat bucket: bad entry {str(entry)[:120]} (expected [name, dtype, shape, offset])")
        dt = _FLAT_DTYPES[dtype]
        numel = 1
        for d in shape:
            numel *= d
        end = off + numel * dt.itemsize
        if off % FLAT_ALIGN or end > flat.numel():
            raise ValueError(f"flat bucket: {tname}: bytes [{off}, {end}) outside the {flat.numel()}-byte buffer")
        out.append((tname, flat[off:end].view(dt).view(shape)))
    return out


def flat_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20) -> Iterator[list]:
    """bucketed(), each bucket sent as one flat tensor: lists of one (name, uint8 tensor) pair, for
    ``update_weights_from_tensor`` with the quads loader (which unflattens and checks every tensor)."""
    for bucket in bucketed(tensors, bucket_bytes):
        yield [flatten_bucket(bucket)]
