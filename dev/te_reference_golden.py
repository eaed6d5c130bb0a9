"""Golden NVFP4 vectors from Transformer Engine's own pure-PyTorch reference quantizer, on CPU.

    python dev/te_reference_golden.py --wheel transformer_engine-2.20.2-py3-none-any.whl \
        --out tests/data/te_nvfp4_golden.safetensors

Loads ``transformer_engine/pytorch/custom_recipes/{reference_utils,gemm,reference_nvfp4}.py`` straight
from the wheel (nothing else of TE is imported: its CUDA-only base classes ``Quantizer`` and
``QuantizedTensorStorage`` and the helper ``tensor.utils.is_custom`` get small stand-ins below) and runs
``NVFP4QuantizerRef`` (1x16 blocks, rowwise, no RHT) on a fixed set of inputs under every variant TE's
recipe can select for a forward tensor: plain, row-scaled (``row_scaled_nvfp4``), and 4over6
(``nvfp4_use_4over6``) with MAE/MSE and a global E4M3 bound of 448/256, per tensor and per row.

Written per input ``<case>.x`` (the input, its own dtype) and per variant ``<case>.<variant>.data`` (packed
E2M1 codes, uint8 [M, K/2]), ``.scale`` (E4M3 block-scale bytes, uint8 [M, K/16]), ``.amax`` (TE's global
amax, fp32 [1] or [M]) and ``.err`` (fp64 [2]: sum |x_hat - x| and sum (x_hat - x)^2 over the tensor, with
TE's decode x_hat = ((value(q) * s_b) * amax) / (6 * e4m3_max) in fp32, the expression its 4over6 error
uses). Metadata: the wheel's sha256, the variants (JSON) and this script's name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import types
import zipfile

import torch
from safetensors.torch import save_file

PKG = "transformer_engine/pytorch/custom_recipes/"

#: variant -> NVFP4QuantizerRef keyword arguments (the quantizer TE's recipe builds for a forward tensor)
VARIANTS: dict[str, dict] = {
    "plain": {},
    "row": {"row_scaled_nvfp4": True},
}
for _mode in ("MAE", "MSE"):
    for _emax in (448, 256):
        for _row in (False, True):
            VARIANTS[f"fos_{_mode.lower()}_{_emax}{'_row' if _row else ''}"] = {
                "nvfp4_use_4over6": True,
                "nvfp4_4over6_err_mode": _mode,
                "nvfp4_e4m3_max": _emax,
                "row_scaled_nvfp4": _row,
            }


def load_te_reference(wheel: str) -> types.ModuleType:
    """TE's reference_nvfp4 module, executed from the wheel's source with stand-ins for CUDA-only imports."""

    class QuantizedTensorStorage:  # stand-in: the reference's container only subclasses it
        pass

    class Quantizer:  # stand-in: the attributes the reference reads
        def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
            self.rowwise_usage = rowwise
            self.columnwise_usage = columnwise
            self.internal = False

    stubs = {
        "transformer_engine": {},
        "transformer_engine.pytorch": {},
        "transformer_engine.pytorch.quantized_tensor": {
            "QuantizedTensorStorage": QuantizedTensorStorage,
            "Quantizer": Quantizer,
        },
        "transformer_engine.pytorch.tensor": {},
        "transformer_engine.pytorch.tensor.utils": {"is_custom": lambda t: getattr(t, "custom", False)},
        "transformer_engine.pytorch.custom_recipes": {},
    }
    for name, attrs in stubs.items():
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so submodules import
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
    with zipfile.ZipFile(wheel) as zf:
        for sub in ("reference_utils", "gemm", "reference_nvfp4"):
            name = f"transformer_engine.pytorch.custom_recipes.{sub}"
            mod = types.ModuleType(name)
            mod.__file__ = f"{wheel}!/{PKG}{sub}.py"
            sys.modules[name] = mod
            setattr(sys.modules["transformer_engine.pytorch.custom_recipes"], sub, mod)
            exec(compile(zf.read(f"{PKG}{sub}.py"), mod.__file__, "exec"), mod.__dict__)
    return sys.modules["transformer_engine.pytorch.custom_recipes.reference_nvfp4"]


def _ties(global_amax: float) -> torch.Tensor:
    """Blocks scaled so that S_enc = 1 and the block scale is 1: elements sit exactly on E2M1 rounding
    midpoints and on the grid (4over6 candidates with equal error: ties pick map-to-6)."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    rows = [
        torch.cat([mids, -mids]),
        torch.cat([grid, -grid]),
        torch.tensor([6.0, 3.0, 0.0, -6.0] * 4),  # exact for both candidates (4/6 of 6 = 4, of 3 = 2)
        torch.tensor([6.0, 4.0, 2.0, 1.0] * 4),
        torch.cat([mids * 2 / 3, -mids * 2 / 3]),
        torch.full((16,), 6.0),
    ]
    x = torch.stack(rows).repeat(1, 2)  # [6, 32]
    x[0, 31] = global_amax  # the global amax, in its own block
    return x


def _with_amax_block(blocks: torch.Tensor, global_amax: float) -> torch.Tensor:
    """fp32 rows [blocks (16) | a block holding global_amax]: per tensor and per row, amax = global_amax."""
    pad = torch.zeros(blocks.shape[0], 16)
    pad[:, 0] = global_amax
    return torch.cat([blocks, pad], dim=1)


def _scale_rounding(global_amax: float) -> torch.Tensor:
    """Blocks whose amax b sits next to an E4M3 rounding midpoint of b / 6 (or 1.5 * b / 6) with S_enc = 1
    (global_amax = 6 * e4m3_max), where (b / 6) * S_enc and b * (S_enc * fp32(1/6)) round to different
    block scales: 4over6 divides, the plain path multiplies by the folded reciprocal."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    six = torch.tensor(6.0)
    rows = []
    for mult in (1.0, 1.5):
        b = mids * 6 / mult
        near = [b]
        for direction in (0.0, 1e9):
            v = b
            for _ in range(4):
                v = torch.nextafter(v, torch.full_like(v, direction))
                near.append(v)
        b = torch.cat(near)
        b = b[(b > 0) & (b < global_amax)]
        split = torch.div(b, six) * mult
        folded = b * torch.reciprocal(six) * mult
        b = b[split.to(torch.float8_e4m3fn).float() != folded.to(torch.float8_e4m3fn).float()]
        rows.append(b[:: max(1, b.numel() // 12)])
    b = torch.cat(rows)
    frac = torch.linspace(-0.95, 0.9, 15)
    return _with_amax_block(torch.cat([b[:, None], b[:, None] * frac], dim=1), global_amax)


def _order_sensitive() -> torch.Tensor:
    """Blocks (found by a seeded search) where 4over6's MAE decision depends on summing the 16 element
    errors in order rather than pairwise, with S_enc = 1 for e4m3_max 448 (rows 0-1) and 256 (rows 2-3)."""
    g = torch.Generator().manual_seed(7)
    b = torch.randn(1_000_000, 16, generator=g) * torch.exp(torch.randn(1_000_000, 1, generator=g))
    picked = b[[11273, 692206]]
    return torch.cat([_with_amax_block(picked, 2688.0), _with_amax_block(picked, 1536.0)])


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(20261205)

    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def heavy(*shape, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g) * 2.5)).to(dtype)

    x: dict[str, torch.Tensor] = {
        "single_1x16": randn(1, 16),
        "randn_bf16_8x64": randn(8, 64),
        "heavy_bf16_16x256": heavy(16, 256),
        "randn_fp32_4x32": randn(4, 32, dtype=torch.float32),
        "heavy_fp32_12x96": heavy(12, 96, dtype=torch.float32),
        "randn_fp16_3x48": randn(3, 48, dtype=torch.float16, scale=30.0),
        "wide_bf16_2x1024": heavy(2, 1024),
        "tall_bf16_96x32": randn(96, 32, scale=0.01),
        "large_bf16_32x512": heavy(32, 512),
        "batched_bf16_2x3x64": heavy(2, 3, 64),
        "zeros_4x32": torch.zeros(4, 32, dtype=torch.bfloat16),
        "ties_448_6x32": _ties(2688.0),
        "ties_256_6x32": _ties(1536.0),
        "ties_fp32_6x32": _ties(2688.0).float() * 0.001,
    }
    z = randn(6, 64)
    z[1] = 0.0  # a zero row
    z[3, 16:48] = 0.0  # zero blocks
    z[4, ::2] = -0.0  # negative zeros
    x["zero_rows_6x64"] = z
    s = randn(8, 64)
    s[0] = 1e4  # the global amax row: its block scales saturate (map-to-4 at 1.5 * 448 clips)
    s[1, :16] = 9e3
    s[2, :16] = 1e-3  # tiny blocks: subnormal E4M3 scales
    s[2, 16:32] = 1e-6  # below the smallest E4M3 scale: zero block scale, non-zero data
    s[3, 32:48] = 2e-5
    x["saturate_subnormal_8x64"] = s
    o = randn(4, 128, scale=0.01)
    o[2, 77] = 500.0  # one outlier
    x["outlier_4x128"] = o
    m = randn(8, 64)
    m *= torch.tensor([1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3, 1e4]).to(torch.bfloat16)[:, None]
    x["row_magnitudes_8x64"] = m
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    idx = torch.randint(0, 8, (16, 64), generator=g)
    sign = torch.where(torch.rand(16, 64, generator=g) < 0.5, -1.0, 1.0)
    pow2 = 2.0 ** torch.randint(-3, 4, (16, 4), generator=g).float().repeat_interleave(16, dim=1)
    x["grid_values_16x64"] = (grid[idx] * sign * pow2).to(torch.bfloat16)
    x["scale_rounding_448"] = _scale_rounding(2688.0)
    x["scale_rounding_256"] = _scale_rounding(1536.0)
    x["order_sensitive_4x32"] = _order_sensitive()
    return x


def te_decode(ref: types.ModuleType, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, e4m3_max: int):
    """TE's dequantization of its own result, fp32 [M, K]: ((value(q) * s_b) * amax) / (6 * e4m3_max),
    as its 4over6 error computation (and its GEMM's alpha) decodes; amax [1] or [M] (row-scaled)."""
    vals = ref.cast_from_fp4x2(data, torch.float32)
    m, k = vals.shape
    v = vals.view(m, k // 16, 16) * scale.to(torch.float32).view(m, k // 16, 1)
    a = amax.view(-1, 1, 1) if amax.numel() > 1 else amax
    v = v * a
    return (v / torch.tensor(6.0 * e4m3_max, dtype=torch.float32)).view(m, k)


def generate(wheel: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    ref = load_te_reference(wheel)
    e2m1 = sys.modules["transformer_engine.pytorch.custom_recipes.reference_utils"].Fp4Formats.E2M1
    out: dict[str, torch.Tensor] = {}
    for case, x in inputs().items():
        out[f"{case}.x"] = x.contiguous()
        x2 = x.reshape(-1, x.shape[-1])
        for variant, kwargs in VARIANTS.items():
            q = ref.NVFP4QuantizerRef(dtype=e2m1, rowwise=True, columnwise=False, **kwargs).quantize(x)
            amax = q.global_amax_row.to(torch.float32).reshape(-1)
            dq = te_decode(ref, q.data, q.scale, amax, q.nvfp4_e4m3_max).double()
            diff = dq - x2.double()
            err = torch.tensor([diff.abs().sum().item(), diff.square().sum().item()], dtype=torch.float64)
            if not all(math.isfinite(float(e)) for e in err):
                raise SystemExit(f"{case} {variant}: non-finite error")
            out[f"{case}.{variant}.data"] = q.data.contiguous()
            out[f"{case}.{variant}.scale"] = q.scale.contiguous().view(torch.uint8)
            out[f"{case}.{variant}.amax"] = amax.contiguous()
            out[f"{case}.{variant}.err"] = err
    with open(wheel, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    meta = {
        "generator": "dev/te_reference_golden.py",
        "source": f"{wheel.rsplit('/', 1)[-1]} {PKG}reference_nvfp4.py (NVFP4QuantizerRef)",
        "wheel_sha256": digest,
        "variants": json.dumps(VARIANTS, sort_keys=True),
        "decode": "((value(q) * s_b) * amax) / (6 * e4m3_max), fp32",
    }
    return out, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", required=True, help="transformer_engine-2.20.2-py3-none-any.whl")
    ap.add_argument("--out", default="tests/data/te_nvfp4_golden.safetensors")
    args = ap.parse_args()
    tensors, meta = generate(args.wheel)
    save_file(tensors, args.out, metadata=meta)
    cases = sum(k.endswith(".data") for k in tensors)
    print(f"{args.out}: {cases} golden cases ({len(VARIANTS)} variants), wheel sha256 {meta['wheel_sha256'][:16]}")


if __name__ == "__main__":
    main()
