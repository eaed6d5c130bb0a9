"""Tile configurations of the kernels: one validated frozen dataclass per kernel kind, and the tuned
choices as data (configs/<kind>.json, written by the dev/ tile probes with --write-config).

A data file holds, per device name (torch.cuda.get_device_name with spaces as "_", e.g. NVIDIA_H200),
an ordered list of rules; the first rule whose conditions all hold gives the tile:

    {"max_rows": 4096, "tile": {...}}     rows <= max_rows     (rows: grouped rows, or rows quantized)
    {"min_rows": 8192, ...}               rows >= min_rows
    {"max_k": 1024, ...}                  K <= max_k (the GEMM's inner size: fc2's is the expert's intermediate)
    {"n_multiple_of": 192, ...}           N % n_multiple_of == 0
    {"out_bytes": 2, ...}                 the output dtype's itemsize
    {"rac": true, ...}, {"gated": true}   activation quantization: a RAC selection given / SiLU*up fused

A device the file does not name gets its "default_device" entry (also on the CPU interpreter).
Every tile is checked by its dataclass when the file is first read: a bad file fails at once, naming
the file, device and rule (KernelConfigError).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from importlib import resources

import torch

from quads_megatron.errors import KernelConfigError

KINDS = ("triton_gemm", "wgmma_gemm", "mma_gemm", "act_quant")
CONDITIONS = {  # the conditions a kind's rules may state (facts its lookup knows)
    "triton_gemm": ("max_rows", "min_rows", "max_k"),
    "mma_gemm": ("max_rows", "min_rows", "max_k"),
    "wgmma_gemm": ("max_rows", "min_rows", "max_k", "n_multiple_of", "out_bytes"),
    "act_quant": ("max_rows", "min_rows", "rac", "dynamic", "gated"),
}


def _pow2(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def _check_ints(cfg: object, names: tuple[str, ...]) -> None:
    for name in names:
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise KernelConfigError(f"{type(cfg).__name__}.{name} must be an int, got {v!r}")


@dataclass(frozen=True)
class TritonGemmConfig:
    """Tiles of the Triton grouped GEMM (gemm_triton.grouped_w4a4): block_m grouped rows x block_n
    output columns per program, block_k of K per step (K must be a multiple of it), warps and
    software-pipeline stages."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        _check_ints(self, ("block_m", "block_n", "block_k", "num_warps", "num_stages"))
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not (_pow2(v) and 16 <= v <= 512):
                raise KernelConfigError(f"TritonGemmConfig.{name}={v}: a power of two in [16, 512]")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise KernelConfigError(f"TritonGemmConfig.num_warps={self.num_warps}: 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise KernelConfigError(f"TritonGemmConfig.num_stages={self.num_stages}: at least 1")


@dataclass(frozen=True)
class WgmmaConfig:
    """Tiles of the Gluon Hopper GEMM (gemm_wgmma_launch.grouped_w4a4_wgmma).

    block_t: token rows per tile (wgmma's N); num_warps: consumer warps, 64 weight rows per warpgroup;
    stages: ring depth; chunks: 128-K chunks per pipeline step; unroll: k-steps per straight-line run
    (warp-specialized kernel: unroll > 1 with 2 chunks keeps a slot's first wgmma in flight under the
    second decode); loader_warps > 0: the warp-specialized kernel with that many cp.async loader warps;
    maxnreg: the launch's register cap (None: ptxas decides); ctas_per_sm > 0: persistent CTAs, SMs *
    ctas_per_sm of them; split: one partition per consumer warpgroup; mask_rows: rows past an expert
    zero-filled, not read; narrow: tiles with at most block_t / 2 rows left run half-width wgmmas;
    tma_store: full output tiles leave by TMA bulk stores; l2_prefetch (with loader warps): how many chunks
    ahead of the step it fills the loader asks L2 for the weight bytes (PTX prefetch.global.L2; 0: none).
    Rules that need the shape (N, K, the output dtype) are checked at launch.
    """

    block_t: int
    num_warps: int
    stages: int
    chunks: int = 1
    unroll: int = 1
    loader_warps: int = 0
    maxnreg: int | None = None
    ctas_per_sm: int = 0
    split: bool = False
    mask_rows: bool = True
    narrow: bool = False
    tma_store: bool = False
    l2_prefetch: int = 0

    def __post_init__(self) -> None:
        _check_ints(self, ("block_t", "num_warps", "stages", "chunks", "unroll", "loader_warps", "maxnreg"))
        _check_ints(self, ("ctas_per_sm", "l2_prefetch"))
        for name in ("split", "mask_rows", "narrow", "tma_store"):
            if not isinstance(getattr(self, name), bool):
                raise KernelConfigError(f"WgmmaConfig.{name} must be a bool, got {getattr(self, name)!r}")
        lw = self.loader_warps
        bad = None
        if not (_pow2(self.block_t) and 16 <= self.block_t <= 256):
            bad = f"block_t={self.block_t} (a power of two in [16, 256])"
        elif self.num_warps not in ((4, 8, 12, 16) if lw else (4, 8)):
            bad = f"num_warps={self.num_warps} (4 or 8, 12 or 16 with loader warps)"
        elif self.stages < 2 or self.unroll < 1 or self.chunks not in (1, 2):
            bad = f"stages={self.stages}, chunks={self.chunks}, unroll={self.unroll} (stages >= 2, chunks 1 or 2)"
        elif lw not in (0, 1, 2, 4) or 32 * lw > 16 * self.num_warps:
            bad = f"loader_warps={lw} (0, 1, 2 or 4, at most one per 32 weight rows of a CTA)"
        elif self.maxnreg is not None and not 24 <= self.maxnreg <= 256:
            bad = f"maxnreg={self.maxnreg} (24 to 256, or None)"
        elif self.ctas_per_sm < 0 or (self.ctas_per_sm and not lw):
            bad = f"ctas_per_sm={self.ctas_per_sm} (>= 0; persistent CTAs need loader warps)"
        elif (self.split and (not lw or self.num_warps not in (8, 12))) or (self.num_warps == 12 and not self.split):
            bad = f"split={self.split} (with loader warps and num_warps 8 or 12; 12 needs it)"
        elif self.narrow and (not lw or self.block_t < 32):
            bad = f"narrow={self.narrow} (with loader warps and block_t >= 32 only)"
        elif self.tma_store and not self.split:
            bad = f"tma_store={self.tma_store} (split consumers only)"
        elif not 0 <= self.l2_prefetch <= L2_PREFETCH_MAX or (self.l2_prefetch and not lw):
            bad = f"l2_prefetch={self.l2_prefetch} (0 .. {L2_PREFETCH_MAX} chunks, with loader warps)"
        if bad:
            raise KernelConfigError(f"bad wgmma tiles: {bad}")


@dataclass(frozen=True)
class MmaConfig:
    """Tiles of the decode-size Gluon GEMM (gemm_mma_launch.grouped_w4a4_mma): block_t token rows per tile
    (mma.sync's N, 8, 16 or 32), num_warps warps of row_groups x 16 weight rows each, chunks 128-K chunks
    loaded per k-step (fewer where K's chunks do not divide by it: gemm_mma_launch.fit_tile); prefetch:
    instead, one chunk per step with the next chunk's loads issued before this one's decode (a register
    pipeline); weight_loads: the cache hint of the weight codes' and scales' loads (read once): "default",
    "cg" (bypass L1) or "evict_first" (first out of L1), leaving L1 to the activations every warp re-reads;
    weights_first: every chunk's code loads of a k-step issued before its first decode (a run-time zero made
    of all of them joins each chunk's codes, so ptxas cannot sink a load to its own chunk's decode);
    l2_prefetch: how many chunks ahead of the one loaded each warp asks L2 for its weight bytes (PTX
    prefetch.global.L2: bytes in flight that hold no register; 0: none); ctas_per_sm > 0: persistent CTAs, SMs *
    ctas_per_sm of them looping over the tiles (none for row tiles past the last; 0: one CTA per tile)."""

    block_t: int = 8
    num_warps: int = 4
    row_groups: int = 1
    chunks: int = 2
    prefetch: bool = False
    weight_loads: str = "default"
    weights_first: bool = False
    l2_prefetch: int = 0
    ctas_per_sm: int = 0

    def __post_init__(self) -> None:
        _check_ints(self, ("block_t", "num_warps", "row_groups", "chunks", "l2_prefetch", "ctas_per_sm"))
        if not 0 <= self.ctas_per_sm <= 32:
            raise KernelConfigError(f"MmaConfig.ctas_per_sm={self.ctas_per_sm}: 0 (a CTA per tile) .. 32")
        if not 0 <= self.l2_prefetch <= L2_PREFETCH_MAX:
            raise KernelConfigError(f"MmaConfig.l2_prefetch={self.l2_prefetch}: 0 .. {L2_PREFETCH_MAX} chunks")
        for name in ("prefetch", "weights_first"):
            if not isinstance(getattr(self, name), bool):
                raise KernelConfigError(f"MmaConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.prefetch and self.weights_first:
            raise KernelConfigError("MmaConfig: prefetch and weights_first are two K loops; pick one")
        if self.weight_loads not in ("default", "cg", "evict_first"):
            raise KernelConfigError(f"MmaConfig.weight_loads={self.weight_loads!r}: 'default', 'cg' or 'evict_first'")
        if self.block_t not in (8, 16, 32):
            raise KernelConfigError(f"MmaConfig.block_t={self.block_t}: 8, 16 or 32")
        chunks = self.chunk_choices()
        if self.num_warps not in (4, 8) or self.row_groups not in (1, 2, 4) or self.chunks not in chunks:
            raise KernelConfigError(
                f"MmaConfig num_warps={self.num_warps}, row_groups={self.row_groups}, chunks={self.chunks}: "
                f"4 or 8 warps, 1, 2 or 4 row groups, chunks one of {chunks}"
                + ("" if self.weights_first else f" ({MMA_CHUNKS_WEIGHTS_FIRST} with weights_first)")
            )

    def chunk_choices(self) -> tuple[int, ...]:
        """The chunks per k-step this tile's K loop can take (gemm_mma_launch.fit_tile picks among them)."""
        return MMA_CHUNKS_WEIGHTS_FIRST if self.weights_first else MMA_CHUNKS


#: 128-K chunks per k-step the decode-size GEMM can take (fit_tile: the largest dividing K's chunks; 3 of
#: K = 768's 6 chunks spilled at 4 warps, Triton 3.6 sm_90); with weights_first 3 compiles clean (78 registers)
MMA_CHUNKS = (1, 2, 4, 8)
MMA_CHUNKS_WEIGHTS_FIRST = (1, 2, 3, 4, 8)
#: the farthest MmaConfig's and WgmmaConfig's l2_prefetch reach (a CTA's K of 2048 is 16 chunks)
L2_PREFETCH_MAX = 16


@dataclass(frozen=True)
class ActQuantConfig:
    """Tiles of the activation quantization (act_quant): block_m rows per program, block_k of K per
    pass (>= K: the whole row in registers, one read of x), warps; split_row: a whole row of K = a power of
    two + a smaller one held as those two pieces instead of one padded tile (act_quant.row_split; None: where
    no residual is written). A field left None takes the tuned value for the call (act_quant_config)."""

    block_m: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    split_row: bool | None = None

    def __post_init__(self) -> None:
        _check_ints(self, ("block_m", "block_k", "num_warps"))
        if self.split_row is not None and not isinstance(self.split_row, bool):
            raise KernelConfigError(f"ActQuantConfig.split_row={self.split_row!r}: true, false or null")
        if self.block_m is not None and not (_pow2(self.block_m) and self.block_m <= 256):
            raise KernelConfigError(f"ActQuantConfig.block_m={self.block_m}: a power of two up to 256")
        if self.block_k is not None and not (_pow2(self.block_k) and self.block_k >= 16):
            raise KernelConfigError(f"ActQuantConfig.block_k={self.block_k}: a power of two >= 16")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise KernelConfigError(f"ActQuantConfig.num_warps={self.num_warps}: 1, 2, 4, 8 or 16")


_TILE_CLASS = {
    "triton_gemm": TritonGemmConfig,
    "wgmma_gemm": WgmmaConfig,
    "mma_gemm": MmaConfig,
    "act_quant": ActQuantConfig,
}


def device_key(device: torch.device | str | None) -> str:
    """The data files' key of a device: its CUDA name with spaces as '_' ('NVIDIA_H200'); '' off CUDA."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return ""
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def config_path(kind: str) -> str:
    """Path of a kind's data file inside the installed package."""
    return str(resources.files("quads_megatron.kernels").joinpath("configs", f"{kind}.json"))


@functools.cache
def load_table(kind: str) -> dict:
    """A kind's data file, every device's rules checked (KernelConfigError names what is wrong)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r} (one of {KINDS})")
    path = config_path(kind)
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise KernelConfigError(f"{path}: cannot be read as JSON ({e})") from e
    check_table(kind, table, path)
    return table


def check_table(kind: str, table: dict, where: str) -> None:
    """Refuse a kind's table that is not {"default_device": name, "devices": {name: {"rules": [...]}}}
    with a known default device, known conditions, valid tiles and a last rule without conditions."""
    devices = table.get("devices") if isinstance(table, dict) else None
    if not isinstance(devices, dict) or table.get("default_device") not in devices:
        raise KernelConfigError(f"{where}: needs 'devices' and a 'default_device' among them")
    for name, entry in devices.items():
        rules = entry.get("rules") if isinstance(entry, dict) else None
        if not isinstance(rules, list) or not rules:
            raise KernelConfigError(f"{where}: device {name} has no rules")
        for i, rule in enumerate(rules):
            unknown = set(rule) - {*CONDITIONS[kind], "tile"} if isinstance(rule, dict) else {"(not an object)"}
            if unknown or not isinstance(rule.get("tile"), dict):
                raise KernelConfigError(f"{where}: device {name} rule {i}: needs a 'tile'; unknown keys {unknown}")
            try:
                _TILE_CLASS[kind](**rule["tile"])
            except (TypeError, KernelConfigError) as e:
                raise KernelConfigError(f"{where}: device {name} rule {i}: {e}") from e
            if kind == "act_quant" and set(rule["tile"]) - {"split_row"} != {"block_m", "num_warps"}:
                raise KernelConfigError(
                    f"{where}: device {name} rule {i}: an act_quant tile is block_m, num_warps (and split_row)"
                )
        if set(rules[-1]) != {"tile"}:
            raise KernelConfigError(f"{where}: device {name}: the last rule must have no conditions")
    if kind == "act_quant":
        for name, entry in devices.items():
            if not (_pow2(entry.get("chunk_k")) and isinstance(entry.get("whole_row_max_k"), int)):
                raise KernelConfigError(f"{where}: device {name} needs whole_row_max_k and a power-of-two chunk_k")
    if kind == "wgmma_gemm":
        for name, entry in devices.items():
            if not isinstance(entry.get("faster_than_triton_above_rows"), int):
                raise KernelConfigError(f"{where}: device {name} needs faster_than_triton_above_rows")
    if kind == "mma_gemm":
        for name, entry in devices.items():
            if not isinstance(entry.get("used_up_to_rows"), int):
                raise KernelConfigError(f"{where}: device {name} needs used_up_to_rows")


def device_entry(kind: str, device: torch.device | str | None = None) -> dict:
    """The entry of a kind's table for device (its default device's where the file does not name it)."""
    table = load_table(kind)
    return table["devices"].get(device_key(device)) or table["devices"][table["default_device"]]


def rule_holds(rule: dict, facts: dict) -> bool:
    """Whether every condition of rule holds for facts (rows, k, n, out_bytes, rac, dynamic, gated)."""
    for key, want in rule.items():
        if key == "tile":
            continue
        if key == "max_rows" and not facts["rows"] <= want:
            return False
        if key == "min_rows" and not facts["rows"] >= want:
            return False
        if key == "max_k" and not (facts.get("k") is not None and facts["k"] <= want):
            return False
        if key == "n_multiple_of" and facts["n"] % want:
            return False
        if key in ("out_bytes", "rac", "dynamic", "gated") and facts[key] != want:
            return False
    return True


def match_rule(kind: str, device: torch.device | str | None = None, **facts) -> tuple[int, dict]:
    """(index, rule) of the first rule of device's entry whose conditions hold for facts."""
    rules = device_entry(kind, device)["rules"]
    return next((i, r) for i, r in enumerate(rules) if rule_holds(r, facts))  # the last rule always holds


def triton_gemm_config(rows: int, k: int, device: torch.device | str | None = None) -> TritonGemmConfig:
    """The tuned tiles of the Triton grouped GEMM at this many grouped rows and inner size K; the data's
    block_k is a ceiling: the largest power of two (>= 16) at most it that divides K."""
    tile = dict(match_rule("triton_gemm", device, rows=rows, k=k)[1]["tile"])
    pref = tile["block_k"]
    fits = [b for b in (512, 256, 128, 64, 32, 16) if b <= pref and k % b == 0]
    if not fits:
        raise ValueError(f"K={k} is not a multiple of 16")
    tile["block_k"] = fits[0]
    return TritonGemmConfig(**tile)


def wgmma_config(
    rows: int,
    n: int,
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    k: int | None = None,
) -> WgmmaConfig:
    """The tuned tiles of the Gluon Hopper GEMM at this many grouped rows (tokens * top-k), N output
    columns, output dtype and inner size K (None: rules that state max_k do not apply)."""
    facts = dict(rows=rows, n=n, out_bytes=out_dtype.itemsize, k=k)
    return WgmmaConfig(**match_rule("wgmma_gemm", device, **facts)[1]["tile"])


def wgmma_faster_than_triton(rows: int, device: torch.device | str | None = None) -> bool:
    """Whether the Gluon GEMM beat the Triton GEMM at this many grouped rows on this device (moe_block's
    impl='auto' follows it)."""
    return rows > device_entry("wgmma_gemm", device)["faster_than_triton_above_rows"]


def mma_config(rows: int, k: int, device: torch.device | str | None = None) -> MmaConfig:
    """The tuned tiles of the decode-size Gluon GEMM at this many grouped rows and inner size K."""
    return MmaConfig(**match_rule("mma_gemm", device, rows=rows, k=k)[1]["tile"])


def mma_used(rows: int, device: torch.device | str | None = None) -> bool:
    """Whether moe_block's impl='auto' runs the decode-size GEMM at this many grouped rows on this device
    (where it beat the other GEMMs in the tile sweep, dev/probe_mma_tiles.py; 0: nowhere)."""
    return rows <= device_entry("mma_gemm", device)["used_up_to_rows"]


def act_quant_config(
    rows: int,
    k: int,
    plan: bool,
    dynamic: bool,
    gated: bool,
    device: torch.device | str | None = None,
    given: ActQuantConfig | None = None,
) -> ActQuantConfig:
    """The activation quantization's tiles for x of rows rows and inner size K (after SiLU*up fusion),
    with a static RAC plan, dynamic RAC channels or neither (rules state `rac` for either, `dynamic` for the
    latter); fields set in given win. block_k: the whole row (K rounded up to a power of two) up to
    whole_row_max_k or with dynamic RAC (it selects per row), else chunk_k; split_row: the rule's, if it states
    one (else None: act_quant.row_split's default)."""
    entry = device_entry("act_quant", device)
    tile = match_rule("act_quant", device, rows=rows, rac=plan or dynamic, dynamic=dynamic, gated=gated)[1]["tile"]
    whole = dynamic or k <= entry["whole_row_max_k"]
    given = given or ActQuantConfig()
    return ActQuantConfig(
        block_m=given.block_m or tile["block_m"],
        block_k=given.block_k or (1 << max(k - 1, 0).bit_length() if whole else entry["chunk_k"]),
        num_warps=given.num_warps or tile["num_warps"],
        split_row=given.split_row if given.split_row is not None else tile.get("split_row"),
    )


def tile_fields(kind: str) -> tuple[str, ...]:
    """The field names of a kind's tile dataclass (what a data file's tile may hold)."""
    return tuple(f.name for f in fields(_TILE_CLASS[kind]))
