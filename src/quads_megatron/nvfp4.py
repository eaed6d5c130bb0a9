"""The NVFP4 scaling contract: the one place where NVFP4 numbers are made.

Every other part of quads_megatron (trainer fake-quant, converter, live weight sync, rollout
kernels and their references) calls this module, so trainer and rollout see the same bits.

Semantics follow Transformer Engine's NVFP4 reference quantizer (1x16 blocks, no RHT, no
stochastic rounding), see shared notes nvfp4-format.md section 2:

* global:   S_enc = min(2688 / amax, FLT_MAX) in fp32; S_enc = 1 when amax == 0 or S_enc == 0;
            S_dec = 1 / S_enc (fp32, exact division). One per tensor, or one per row.
* block:    s_b = e4m3_rne(clamp(b_amax * (S_enc * fp32(1/6)), max=448)) per 16 elements along K.
* element:  e_b = min(1 / (s_b * S_dec), FLT_MAX);  q = e2m1_rne(clamp(x * e_b, -6, 6)).
* decode:   x_hat = (value(q) * s_b) * S_dec (the first product is exact: one rounding).
* packing:  byte j = code[2j] | code[2j+1] << 4 (even element in the low nibble).

E2M1 code = sign << 3 | index into (0, .5, 1, 1.5, 2, 3, 4, 6); the sign bit is set for values
strictly below zero (so -0.0 encodes as +0, like TE's reference).

Variants (NVFP4Recipe, the options of TE's NVFP4QuantizerRef; default = the rules above):

* 4over6 (``use_4over6``): S_enc = min(6 * e4m3_max / amax, FLT_MAX) with e4m3_max 448 or 256; per block
  base = (b_amax / 6) * S_enc, candidates s_4 = e4m3(1.5 * base) (block max to 4) and s_6 = e4m3(base)
  (to 6), each encoded as above; their error sum_i |d_i| (MAE) or sum_i d_i^2 (MSE), summed in element
  order, d_i = ((value(q_i) * s) * amax) / (6 * e4m3_max) - x_i; s_4 wins only when strictly lower.
* row-scaled (TE's ``row_scaled_nvfp4``): scale_mode='row', one global amax per row.
The decode is the same for every variant, so the ModelOpt names below hold for all of them.

ModelOpt names the same numbers: ``weight`` = packed codes, ``weight_scale`` = s_b,
``weight_scale_2`` = S_dec (within one ulp of amax/2688; we ship the exact decode factor so
``(value(q) * weight_scale) * weight_scale_2`` is bit-identical to our dequantization), and
``input_scale`` = S_dec of a calibrated activation amax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from quads_megatron.errors import NVFP4InputError

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP32_MAX = torch.finfo(torch.float32).max
#: magnitudes of the 8 E2M1 codes (index = code & 7)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: RNE decision points between neighbouring E2M1 magnitudes; a value equal to a point goes
#: to the neighbour with the even index (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

ScaleMode = Literal["tensor", "row"]
SCALE_MODES: tuple[str, ...] = ("tensor", "row")
#: global E4M3 bounds a recipe may scale to (TE: nvfp4_e4m3_max, 256 only with 4over6)
E4M3_MAX_CHOICES = (448, 256)
#: 4over6 candidate error metrics (TE: nvfp4_4over6_err_mode)
ERR_MODES = ("MAE", "MSE")


@dataclass(frozen=True)
class NVFP4Recipe:
    """How one tensor is quantized: the options of TE's NVFP4QuantizerRef, named without its ``nvfp4_``
    prefix. The default is plain NVFP4 (every function here is then what it was without recipes).

    use_4over6: per block, scale the block max to 4 or to 6, whichever has the lower error (TE 2.17+).
    e4m3_max: the E4M3 bound the global scale maps amax to (S_enc = 6 * e4m3_max / amax): 448, or 256
        with 4over6 (which leaves map-to-4 scales room below 448).
    err_mode: 4over6's error metric, 'MAE' or 'MSE' (upper case, as TE; lower case is accepted).
    Row scaling (TE's row_scaled_nvfp4) is quantize's scale_mode='row', not a recipe field. Options that
    would change nothing (e4m3_max 256 or err_mode MSE without 4over6) are refused rather than ignored.
    """

    use_4over6: bool = False
    e4m3_max: int = 448
    err_mode: str = "MAE"

    def __post_init__(self) -> None:
        if not isinstance(self.use_4over6, bool):
            raise TypeError(f"NVFP4Recipe.use_4over6 must be a bool, got {self.use_4over6!r}")
        if isinstance(self.e4m3_max, bool) or self.e4m3_max not in E4M3_MAX_CHOICES:
            raise ValueError(f"NVFP4Recipe.e4m3_max must be one of {E4M3_MAX_CHOICES}, got {self.e4m3_max!r}")
        if not isinstance(self.err_mode, str) or self.err_mode.upper() not in ERR_MODES:
            raise ValueError(f"NVFP4Recipe.err_mode must be one of {ERR_MODES}, got {self.err_mode!r}")
        object.__setattr__(self, "e4m3_max", int(self.e4m3_max))
        object.__setattr__(self, "err_mode", self.err_mode.upper())
        if not self.use_4over6 and (self.e4m3_max != 448 or self.err_mode != "MAE"):
            raise ValueError(
                f"NVFP4Recipe: e4m3_max={self.e4m3_max} / err_mode={self.err_mode!r} apply to 4over6 only "
                "(use_4over6=True); plain NVFP4 scales to 448"
            )

    @property
    def global_scale_numerator(self) -> float:
        """6 * e4m3_max: S_enc = this / amax (2688, or 1536 for e4m3_max 256)."""
        return E2M1_MAX * self.e4m3_max

    def to_dict(self) -> dict[str, object]:
        return {"use_4over6": self.use_4over6, "e4m3_max": self.e4m3_max, "err_mode": self.err_mode}


#: plain NVFP4 (no 4over6, global scale to 448): what every recipe= argument defaults to
DEFAULT_RECIPE = NVFP4Recipe()


def _recipe(recipe: NVFP4Recipe | None) -> NVFP4Recipe:
    if recipe is None:
        return DEFAULT_RECIPE
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"recipe must be an NVFP4Recipe or None, got {type(recipe).__name__}")
    return recipe


@dataclass(frozen=True)
class NVFP4Tensor:
    """An NVFP4-quantized tensor of logical shape [..., K].

    codes:         uint8 [..., K/2]   two E2M1 codes per byte, even element in the low nibble
    block_scales:  float8_e4m3fn [..., K/16]
    global_decode: float32 [] (per tensor) or [..., 1] (per row); S_dec = 1/S_enc
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_decode: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def to_modelopt(self) -> dict[str, torch.Tensor]:
        return to_modelopt(self)

    def same_bits(self, other: NVFP4Tensor) -> bool:
        """Identical codes, block-scale bytes and global decode scales (shapes included)."""
        return (
            torch.equal(self.codes, other.codes)
            and torch.equal(self.block_scales.view(torch.uint8), other.block_scales.view(torch.uint8))
            and torch.equal(self.global_decode, other.global_decode)
        )


# ----------------------------------------------------------------------------- validation


def check_quantizable(x: torch.Tensor, name: str = "tensor") -> None:
    """Raise NVFP4InputError unless x is a finite floating tensor whose last dim is a multiple of 16."""
    if not isinstance(x, torch.Tensor):
        raise NVFP4InputError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise NVFP4InputError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise NVFP4InputError(f"{name}: expected at least 1 dimension, got a scalar")
    k = x.shape[-1]
    if k == 0 or k % BLOCK_SIZE:
        raise NVFP4InputError(
            f"{name}: last dimension K={k} must be a positive multiple of {BLOCK_SIZE} "
            f"(NVFP4 1x{BLOCK_SIZE} blocks along K); shape {tuple(x.shape)}"
        )
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        kind = "NaN" if bool(torch.isnan(x).any()) else "Inf"
        raise NVFP4InputError(
            f"{name}: contains {kind} (first non-finite element at index {bad}); "
            "refusing to quantize, nothing was written"
        )


# ----------------------------------------------------------------------------- scales


def amax(x: torch.Tensor, scale_mode: ScaleMode = "tensor") -> torch.Tensor:
    """max|x| as fp32: [] for 'tensor', [..., 1] for 'row'."""
    if scale_mode == "tensor":
        return x.detach().abs().amax().float()
    if scale_mode == "row":
        return x.detach().abs().amax(dim=-1, keepdim=True).float()
    raise NVFP4InputError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")


def global_encode_scale(global_amax: torch.Tensor, recipe: NVFP4Recipe | None = None) -> torch.Tensor:
    """S_enc = min(6 * e4m3_max / amax, FLT_MAX) in fp32 (2688 / amax by default), 1 where amax == 0 or
    S_enc == 0 (same shape)."""
    a = global_amax.float()
    s = torch.clamp(torch.div(_recipe(recipe).global_scale_numerator, a), max=FP32_MAX)
    return torch.where((a == 0) | (s == 0), torch.ones_like(s), s)


def global_decode_scale(global_amax: torch.Tensor, recipe: NVFP4Recipe | None = None) -> torch.Tensor:
    """S_dec = 1 / S_enc (fp32, correctly rounded division)."""
    return torch.div(1.0, global_encode_scale(global_amax, recipe))


def e4m3_rne(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to E4M3 (RNE, saturating at +-448); returns float8_e4m3fn."""
    return torch.clamp(x.float(), min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)


def block_scales_from_amax(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """s_b = e4m3(b_amax * (S_enc * fp32(1/6))); block_amax fp32 [..., K/16], s_enc broadcastable."""
    multiplier = s_enc.float() * torch.reciprocal(torch.tensor(E2M1_MAX, dtype=torch.float32))
    return e4m3_rne(torch.clamp(block_amax.float() * multiplier.to(block_amax.device), max=FP32_MAX))


# ----------------------------------------------------------------------------- E2M1 codes


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of fp32 values already scaled into [-6, 6] (larger saturate)."""
    a = v.abs()
    m = E2M1_MIDPOINTS
    idx = (
        (a > m[0]).to(torch.uint8)
        + (a >= m[1]).to(torch.uint8)
        + (a > m[2]).to(torch.uint8)
        + (a >= m[3]).to(torch.uint8)
        + (a > m[4]).to(torch.uint8)
        + (a >= m[5]).to(torch.uint8)
        + (a > m[6]).to(torch.uint8)
    )
    return idx | ((v < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 codes (uint8, 0..15), same shape."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    table = torch.cat([table, -table])
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> packed uint8 [..., K/2] (even element in the low nibble)."""
    if codes.shape[-1] % 2:
        raise NVFP4InputError(f"pack_e2m1: last dimension {codes.shape[-1]} must be even")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> uint8 codes [..., K]."""
    if packed.dtype != torch.uint8:
        raise NVFP4InputError(f"unpack_e2m1: expected uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- quantize


def quantize(
    x: torch.Tensor,
    scale_mode: ScaleMode = "tensor",
    global_amax: torch.Tensor | None = None,
    check: bool = True,
    recipe: NVFP4Recipe | None = None,
) -> NVFP4Tensor:
    """Quantize x [..., K] (K % 16 == 0) to NVFP4.

    scale_mode: 'tensor' (one global scale) or 'row' (one per row along the last dim: TE's row-scaled).
    global_amax: override the global amax (e.g. the shared amax of fused gate/up w1|w3, or a
        calibrated activation amax); shape [] for 'tensor' or [..., 1] for 'row'.
    check: validate finiteness and shape (raise NVFP4InputError); leave on unless the caller
        has just checked.
    recipe: the variant (NVFP4Recipe; None = plain NVFP4); 4over6 also uses global_amax in its error.
    """
    recipe = _recipe(recipe)
    if check:
        check_quantizable(x, "quantize input")
    if scale_mode not in SCALE_MODES:
        raise NVFP4InputError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    xf = x.detach().float()
    if global_amax is None:
        global_amax = amax(xf, scale_mode)
    else:
        global_amax = global_amax.detach().float().to(xf.device)
        if scale_mode == "tensor" and global_amax.numel() != 1:
            raise NVFP4InputError(f"per-tensor global_amax must have one element, got {tuple(global_amax.shape)}")
        if scale_mode == "tensor":
            global_amax = global_amax.reshape(())
        if not bool(torch.isfinite(global_amax).all()) or bool((global_amax < 0).any()):
            raise NVFP4InputError("global_amax must be finite and non-negative")
    s_enc = global_encode_scale(global_amax, recipe)
    s_dec = torch.div(1.0, s_enc)
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1)
    # per-row S_enc/S_dec are [..., 1] and broadcast over the K/16 blocks of their row
    if recipe.use_4over6:
        scales, codes = _four_over_six(blocks, block_amax, global_amax, s_enc, s_dec, recipe)
    else:
        scales = block_scales_from_amax(block_amax, s_enc)
        codes = _encode_blocks(blocks, scales, s_dec)
    return NVFP4Tensor(codes=pack_e2m1(codes.reshape(xf.shape)), block_scales=scales, global_decode=s_dec)


def per_slice_rows(global_amax: torch.Tensor, rows: int) -> torch.Tensor:
    """[B] per-tensor amaxes -> the [B * rows, 1] per-row amaxes of the B tensors stacked as rows: a
    'row'-scaled quantization under them gives every element the S_enc of its own tensor, so the bits of
    quantizing each tensor alone ('tensor' scale), in one pass."""
    return global_amax.float().reshape(-1).repeat_interleave(rows).unsqueeze(-1)


def quantize_each(
    x: torch.Tensor, global_amax: torch.Tensor | None = None, recipe: NVFP4Recipe | None = None
) -> list[NVFP4Tensor]:
    """quantize(x[b], "tensor", global_amax[b]) of every x[b] of x [B, ..., K], in one pass (per_slice_rows),
    bit for bit the same. global_amax: [B] or None (each slice's own amax)."""
    check_quantizable(x, "quantize_each input")
    if x.dim() < 2:
        raise NVFP4InputError(f"quantize_each: expected [B, ..., K], got shape {tuple(x.shape)}")
    b, k = x.shape[0], x.shape[-1]
    if global_amax is None:
        global_amax = x.detach().abs().amax(dim=tuple(range(1, x.dim()))).float()
    elif global_amax.numel() != b:
        raise NVFP4InputError(f"quantize_each: global_amax needs {b} values, got {global_amax.numel()}")
    rows = x[0].numel() // k
    if rows == 0:
        raise NVFP4InputError(f"quantize_each: empty slices, shape {tuple(x.shape)}")
    q = quantize(x.reshape(-1, k), "row", per_slice_rows(global_amax.to(x.device), rows), check=False, recipe=recipe)
    codes, scales = q.codes.reshape(*x.shape[:-1], k // 2), q.block_scales.reshape(*x.shape[:-1], k // BLOCK_SIZE)
    return [NVFP4Tensor(codes[i], scales[i], q.global_decode[i * rows].reshape(())) for i in range(b)]


def _encode_blocks(blocks: torch.Tensor, scales: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [..., K/16, 16] of fp32 blocks under E4M3 block scales [..., K/16] and S_dec."""
    enc = torch.clamp(torch.div(1.0, scales.float() * s_dec), max=FP32_MAX)
    return e2m1_encode(torch.clamp(blocks * enc.unsqueeze(-1), -E2M1_MAX, E2M1_MAX))


def _four_over_six(
    blocks: torch.Tensor,
    block_amax: torch.Tensor,
    global_amax: torch.Tensor,
    s_enc: torch.Tensor,
    s_dec: torch.Tensor,
    recipe: NVFP4Recipe,
) -> tuple[torch.Tensor, torch.Tensor]:
    """4over6 block scales [..., K/16] and codes [..., K/16, 16] of fp32 blocks (module docstring).

    The candidates' errors decode with amax / (6 * e4m3_max), as TE's reference does (not S_dec), and
    are summed element by element in order, so near-equal candidates are decided as TE decides them.
    Both divisors are tensors on the blocks' device: PyTorch's CUDA division by a host scalar multiplies by
    its reciprocal, which is not the correctly rounded quotient (the Triton twin's and the CPU's).
    """
    base = torch.div(block_amax, torch.full_like(block_amax, E2M1_MAX)) * s_enc
    amax_b = global_amax.float().unsqueeze(-1)  # [] -> [1], [..., 1] -> [..., 1, 1]: over the blocks' elements
    denom = torch.full((), recipe.global_scale_numerator, dtype=torch.float32, device=blocks.device)
    candidates = []
    for scale in (e4m3_rne(base * 1.5), e4m3_rne(base)):  # map-to-4, map-to-6
        codes = _encode_blocks(blocks, scale, s_dec)
        d = (e2m1_decode(codes) * scale.float().unsqueeze(-1)) * amax_b / denom - blocks
        d = d.abs() if recipe.err_mode == "MAE" else d * d
        err = torch.zeros_like(block_amax)
        for i in range(BLOCK_SIZE):
            err = err + d[..., i]
        candidates.append((scale, codes, err))
    (s4, c4, e4), (s6, c6, e6) = candidates
    pick4 = e4 < e6
    scales = torch.where(pick4, s4.view(torch.uint8), s6.view(torch.uint8)).view(torch.float8_e4m3fn)
    return scales, torch.where(pick4.unsqueeze(-1), c4, c6)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat = (value(q) * s_b) * S_dec in fp32, then cast to dtype; shape [..., K].

    value(q) * s_b is exact in fp32, so x_hat is the correctly rounded q * s_b * S_dec.
    """
    vals = e2m1_decode(unpack_e2m1(t.codes))
    blocks = vals.reshape(*vals.shape[:-1], vals.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    out = (blocks * t.block_scales.float().unsqueeze(-1)).reshape(vals.shape) * t.global_decode.float()
    return out.to(dtype)


def qdq(
    x: torch.Tensor,
    scale_mode: ScaleMode = "tensor",
    global_amax: torch.Tensor | None = None,
    check: bool = True,
    recipe: NVFP4Recipe | None = None,
) -> torch.Tensor:
    """dequantize(quantize(x)) in x.dtype (no gradient: see quads_megatron.fake_quant for STE)."""
    return dequantize(quantize(x, scale_mode, global_amax, check, recipe), x.dtype)


def shared_amax(*tensors: torch.Tensor) -> torch.Tensor:
    """One per-tensor amax over several tensors (e.g. gate w1 and up w3 of one expert)."""
    return torch.stack([amax(t) for t in tensors]).amax()


# ----------------------------------------------------------------------------- ModelOpt naming


def to_modelopt(t: NVFP4Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors of one linear: weight uint8 [N, K/2], weight_scale e4m3 [N, K/16],
    weight_scale_2 fp32 scalar = S_dec. ModelOpt holds one global scale per weight, so a row-scaled
    tensor (scale_mode='row', TE's row_scaled_nvfp4) is refused."""
    if t.global_decode.numel() != 1:
        raise NVFP4InputError(
            f"row-scaled NVFP4 weights (scale_mode='row', TE's row_scaled_nvfp4) have no ModelOpt form: "
            f"weight_scale_2 is one per-tensor scale, got {tuple(t.global_decode.shape)}"
        )
    return {
        "weight": t.codes,
        "weight_scale": t.block_scales,
        "weight_scale_2": t.global_decode.float(),
    }


def from_modelopt(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> NVFP4Tensor:
    """Inverse of to_modelopt; validates dtypes and shapes."""
    if weight.dtype != torch.uint8:
        raise NVFP4InputError(f"weight: expected packed uint8, got {weight.dtype}")
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise NVFP4InputError(f"weight_scale: expected float8_e4m3fn, got {weight_scale.dtype}")
    k = weight.shape[-1] * 2
    if tuple(weight_scale.shape) != (*weight.shape[:-1], k // BLOCK_SIZE):
        raise NVFP4InputError(
            f"weight_scale shape {tuple(weight_scale.shape)} does not match weight "
            f"{tuple(weight.shape)} (expected {(*weight.shape[:-1], k // BLOCK_SIZE)})"
        )
    return NVFP4Tensor(weight, weight_scale, weight_scale_2.float())


def input_scale_from_amax(act_amax: torch.Tensor, recipe: NVFP4Recipe | None = None) -> torch.Tensor:
    """ModelOpt static ``input_scale`` of a calibrated activation amax: S_dec(amax), fp32 (recipe: the
    activations' variant; e4m3_max 256 makes it amax / 1536)."""
    return global_decode_scale(act_amax.float(), recipe)


def amax_from_input_scale(input_scale: torch.Tensor, recipe: NVFP4Recipe | None = None) -> torch.Tensor:
    """The activation amax a ModelOpt ``input_scale`` (= S_dec = amax / (6 * e4m3_max)) stands for, fp32.
    Its S_enc = 6 * e4m3_max / amax equals 1 / input_scale within 1 ulp (what ModelOpt kernels use)."""
    return input_scale.float() * _recipe(recipe).global_scale_numerator
