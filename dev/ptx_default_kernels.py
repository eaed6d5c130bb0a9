"""Offline sm_90 PTX of the default NVFP4 quantize kernels, to check that a change leaves them alone.

    python dev/ptx_default_kernels.py > before.txt   # on the old tree
    python dev/ptx_default_kernels.py > after.txt    # on the new tree; diff the two

Compiles (no GPU: Triton's own ptxas) the Triton quantize twin and the activation-quantization kernel
in their default configurations (several tile and mode combinations) and prints one line per kernel:
its name, the sha256 of its PTX (without line info) and the PTX length. Constexprs a newer kernel has and this list does
not name get their default-off values from EXTRA_DEFAULTS (the options a change adds must compile
away when off). Run without TRITON_INTERPRET.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1")
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # no .loc / debug sections: the hash is the code, not its line numbers

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from quads_megatron.kernels import act_quant, nvfp4_quant  # noqa: E402

#: values of constexprs added after the baseline, in their default (off) setting
EXTRA_DEFAULTS = {"FOUR_OVER_SIX": False, "FOS_MSE": False, "E4M3_MAX": 448.0}


def _fn(kernel):
    return kernel.fn if hasattr(kernel, "fn") else kernel


def compile_ptx(kernel, types: dict[str, str], consts: dict, num_warps: int = 4) -> str:
    fn = _fn(kernel)
    names = list(inspect.signature(fn).parameters)
    consts = {**{k: v for k, v in EXTRA_DEFAULTS.items() if k in names}, **consts}
    signature = {n: ("constexpr" if n in consts else types[n]) for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def quantize_kernels():
    types = {
        "x_ptr": "*bf16",
        "s_enc_ptr": "*fp32",
        "s_dec_ptr": "*fp32",
        "codes_ptr": "*u8",
        "scales_ptr": "*u8",
        "M": "i32",
        "K": "i32",
        "stride_xm": "i32",
        "s_stride": "i32",
    }
    for bm, bk in ((16, 128), (8, 64)):
        yield f"quantize_{bm}x{bk}", compile_ptx(nvfp4_quant._quantize_kernel, types, {"BLOCK_M": bm, "BLOCK_K": bk})


def act_quant_kernels():
    types = {
        "x_ptr": "*bf16",
        "valid_ptr": "*i8",
        "amax_ptr": "*fp32",
        "mask_ptr": "*i8",
        "codes_ptr": "*u8",
        "scales_ptr": "*u8",
        "rcodes_ptr": "*u8",
        "rscales_ptr": "*u8",
        "op_ptr": "*fp16",
        "sdec_ptr": "*fp32",
        "offs_ptr": "*i32",
        "tmap_ptr": "*i32",
        "M": "i32",
        "stride_xm": "i32",
        "n_sel": "i32",
        "n_tm": "i32",
        "E": "i32",
        "P": "i32",
    }
    base = dict(
        STATIC=False, HAS_RES=False, DYNAMIC=False, OPERAND=False, WGMMA_ORDER=False, GATED=False,
        HAS_VALID=False, X_BF16=True, BLOCK_M=8, BLOCK_K=256, HAS_TM=False, TM_BM=1, TM_BLOCK_E=2,
        TM_BLOCK_P=32, PDL=False,
    )  # fmt: skip
    cases = {
        "codes": dict(K=256),
        "codes_static": dict(K=256, STATIC=True),
        "codes_two_pass": dict(K=512),
        "codes_dynamic_rac": dict(K=256, HAS_RES=True, DYNAMIC=True),
        "codes_static_rac": dict(K=256, HAS_RES=True),
        "operand_pairs_rac": dict(K=256, OPERAND=True, HAS_RES=True, DYNAMIC=True),
        "operand_wgmma_gated": dict(K=256, OPERAND=True, WGMMA_ORDER=True, GATED=True, HAS_VALID=True, HAS_TM=True),
    }
    for name, extra in cases.items():
        yield f"act_quant_{name}", compile_ptx(act_quant._act_quant_kernel, types, {**base, **extra})


def main() -> None:
    for name, ptx in (*quantize_kernels(), *act_quant_kernels()):
        print(f"{name} {hashlib.sha256(ptx.encode()).hexdigest()[:16]} {len(ptx)}")


if __name__ == "__main__":
    main()
