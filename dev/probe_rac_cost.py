"""Device probe: where RAC's extra time goes (activation+residual quant vs GEMM), and quant tilings.

python dev/probe_rac_cost.py     (CUDA GPU; CUDA-graph replay timings)
"""

import os
import sys

import torch
import triton.testing

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_moe_w4a4 import HIDDEN, INTER, E, routing  # noqa: E402

from quads_megatron import nvfp4  # noqa: E402
from quads_megatron.config import RACConfig  # noqa: E402
from quads_megatron.kernels import act_quant, gemm_triton  # noqa: E402
from quads_megatron.kernels.tile_configs import ActQuantConfig, TritonGemmConfig  # noqa: E402
from quads_megatron.rollout import rac_plan, reference  # noqa: E402


def t(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [nvfp4.quantize(torch.randn(2 * INTER, HIDDEN, generator=g, device="cuda") * 0.02) for _ in range(E)]
    wc, wsc, wsd = gemm_triton.stack_expert_weights(ws)
    for tokens in (16, 256, 4096):
        offs, _ = routing(tokens, g)
        rows = int(offs[-1])
        x = torch.randn(rows, HIDDEN, generator=g, device="cuda").bfloat16()
        plan = rac_plan.RACPlan.from_scores(
            reference.residual_block_scores(x[:256]).sum(0), RACConfig(ratio=0.5).num_channels(HIDDEN)
        )
        mask = plan.block_mask("cuda").to(torch.int8)
        line = [f"tokens {tokens}"]
        for bm, bk in ((1, None), (4, None), (16, None), (4, 256), (16, 128)):
            for p in (None, plan):
                name = f"quant{'+rac' if p else ''} bm{bm} bk{bk or 'row'}"
                qkw = dict(check=False, config=ActQuantConfig(block_m=bm, block_k=bk), block_mask=mask if p else None)
                line.append(f"{name}={t(lambda p=p, qkw=qkw: act_quant.quantize_activation(x, p, **qkw)):.1f}")
        qa0, qa = act_quant.quantize_activation(x), act_quant.quantize_activation(x, plan, block_mask=mask)
        bm = 16 if rows < 4096 else 128
        kw = TritonGemmConfig(block_m=bm, block_n=128, block_k=128 if bm == 16 else 64, num_warps=4 if bm == 16 else 8)
        line.append(f"gemm={t(lambda: gemm_triton.grouped_w4a4(qa0, offs, wc, wsc, wsd, config=kw)):.1f}")
        line.append(f"gemm+rac={t(lambda: gemm_triton.grouped_w4a4(qa, offs, wc, wsc, wsd, mask, config=kw)):.1f}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
