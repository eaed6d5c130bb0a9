"""Decode speed of the whole MoE expert block at Qwen3-30B-A3B expert shapes (128 experts, hidden 2048,
moe intermediate 768, top-8), random routing, the same inputs for every arm, CUDA-graph replays:

* ours: quads_megatron moe_w4a4(impl="auto"), W4A4 NVFP4 (what the quads_nvfp4 SGLang method runs), on
  --layout's expert weights (default tiled, kernels/weight_layout.py: what the method serves at these
  shapes; ours_other_layout: the same block on the other one; ours_whole_row: with the activation
  quantization's row as one padded tile, QUADS_ACT_SPLIT_ROW=0; ours_torch_route / ours_other_routing: on the
  torch routing / on a routing it does not take, OTHER_ROUTING); ours_rac50: + dynamic RAC 50%
  (ours_rac50_other_row: with fc2's row held the other way than its tile holds it); ours_rac50_static: + static
  RAC 50% plans (timing depends on the count);
* sglang_fp8 / sglang_fp8_tensor / sglang_bf16: SGLang's own fused MoE as its engine runs it on Hopper
  (fused_experts: moe_align_block_size, its Triton GEMMs, fused SiLU*up, top-k sum) for FP8 w8a8
  block [128, 128] weights, per-tensor FP8 weights (what quantization="fp8" makes online) and bf16, each
  with the kernel config SGLang ships for this GPU (its default where it ships none: on the H100);
* sglang_fp8_tuned / sglang_fp8_tensor_tuned: the FP8 block / per-tensor arm with the fastest of SGLang's
  own config and PEER_GRIDS' at each size (what SGLang's fused-MoE tuning script would give it), so a GPU
  without a shipped config is not an untuned peer; the winners are written in SGLang's config-file format
  (TUNED_FILES), which bench_engine.py's fp8_tuned arm serves with;
* torch_bf16: the same block on torch._grouped_mm (secondary).

HBM floor per size: bytes of the experts the routing hits (NVFP4 codes + E4M3 block scales + global
scales; FP8 and bf16 likewise) plus bf16 activations in and out, at --hbm-tbps. Once per size ours is
checked against moe_w4a4(impl="reference"), and every arm's output against the bf16 block.

    python benchmarks/bench_moe_block.py [--tokens 16,64,256,1024,4096,16384] [--out DIR]   # GPU, ~2-3 min
    python benchmarks/bench_moe_block.py --dry-run     # CPU: tiny shapes, reference path, no SGLang, no timing

Writes DIR/moe_block.json (rows + date/device/versions), DIR/moe_block.md and, per tuned arm that ran, its
TUNED_FILES entry ({"file": SGLang's config file name, "configs": {tokens: config}}; bench_engine.py
--peer-configs lays them out as SGLANG_MOE_CONFIG_DIR for its fp8_tuned arm).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import bench_env
import torch

from quads_megatron import nvfp4
from quads_megatron.config import RACConfig
from quads_megatron.kernels import act_quant, tile_configs
from quads_megatron.rollout import moe_block as moe
from quads_megatron.rollout import reference
from quads_megatron.rollout.rac_plan import RACPlan

SHAPE = {"experts": 128, "hidden": 2048, "inter": 768, "topk": 8}
TINY = {"experts": 8, "hidden": 256, "inter": 128, "topk": 2}
TOKENS = (16, 64, 256, 1024, 4096, 16384)
ARMS = (
    "ours",
    "ours_rac50",
    "ours_rac50_static",
    "ours_torch_route",
    "ours_no_mma",
    "ours_other_routing",
    "ours_other_layout",
    "ours_whole_row",
    "ours_rac50_other_row",
    "sglang_fp8",
    "sglang_fp8_tuned",
    "sglang_fp8_tensor",
    "sglang_fp8_tensor_tuned",
    "sglang_bf16",
    "torch_bf16",
)
FP8_BLOCK = 128
#: the routing A/B arm 'ours_other_routing' runs, by the routing 'ours' takes (moe_block.routing_path)
OTHER_ROUTING = {"fused": "kernel", "kernel": "chunked", "chunked": "kernel", "torch": "chunked"}
#: HBM bandwidth (TB/s) of the floor by a substring of the GPU's name (the SXM parts); others: --hbm-tbps
HBM_TBPS = {"H200": 4.8, "H100": 3.35}
#: the SGLang arms that run with the config SGLang ships; each tuned arm: the arm whose call it tunes
SHIPPED_CONFIG_ARMS = ("sglang_fp8", "sglang_fp8_tensor", "sglang_bf16")
TUNED_ARMS = {"sglang_fp8_tuned": "sglang_fp8", "sglang_fp8_tensor_tuned": "sglang_fp8_tensor"}
TUNED_FILES = {
    "sglang_fp8_tuned": "sglang_fp8_block_tuned.json",
    "sglang_fp8_tensor_tuned": "sglang_fp8_tensor_tuned.json",
}
#: configs of SGLang's fused-MoE Triton kernel a tuned arm tries after SGLang's own choice (a subset of its
#: tuning script's space); with FP8 block weights BLOCK_SIZE_K stays the block (one weight scale per K step)
_GRID = {"BLOCK_SIZE_M": (16, 32, 64), "BLOCK_SIZE_N": (64, 128), "GROUP_SIZE_M": (16,), "num_warps": (4,)}
PEER_GRIDS = {
    "sglang_fp8": {**_GRID, "BLOCK_SIZE_K": (FP8_BLOCK,), "num_stages": (3, 4, 5)},
    "sglang_fp8_tensor": {**_GRID, "BLOCK_SIZE_K": (128, 256), "num_stages": (3, 4)},
}


# ----------------------------------------------------------------------------- pure parts


def expert_bytes(fmt: str, hidden: int, inter: int) -> int:
    """Bytes one expert's fc1 (gate|up, [2I, H]) and fc2 ([H, I]) weights occupy in HBM."""
    elems = 2 * inter * hidden + hidden * inter
    if fmt == "nvfp4":  # codes (2 per byte) + one E4M3 byte per 16 + an fp32 global scale per GEMM
        return elems // 2 + elems // 16 + 2 * 4
    if fmt == "fp8":  # FP8 codes + fp32 scales per 128x128 block
        blocks = (2 * inter // FP8_BLOCK) * (hidden // FP8_BLOCK) + (hidden // FP8_BLOCK) * (inter // FP8_BLOCK)
        return elems + 4 * blocks
    if fmt == "bf16":
        return 2 * elems
    raise ValueError(f"unknown weight format {fmt!r}")


def floor_us(fmt: str, active_experts: int, tokens: int, shape: dict, tbps: float) -> float:
    """HBM floor (us): weights of the experts hit plus bf16 activations in and out, at tbps TB/s."""
    nbytes = active_experts * expert_bytes(fmt, shape["hidden"], shape["inter"]) + tokens * shape["hidden"] * 2 * 2
    return nbytes / (tbps * 1e12) * 1e6


def peer_candidates(shipped: dict | None, grid: dict) -> list[dict]:
    """SGLang's own config for this size first (the arm is never slower than the shipped peer), then every
    point of grid not equal to it."""
    import itertools

    keys = list(grid)
    out = [dict(shipped)] if shipped else []
    for values in itertools.product(*(grid[k] for k in keys)):
        cfg = dict(zip(keys, values, strict=True))
        if cfg not in out:
            out.append(cfg)
    return out


def tuned_config_file(result: dict, arm: str) -> dict:
    """A tuned arm's winners in SGLang's config-file layout: {"file": the name SGLang looks up for this GPU,
    shape and weight format, "configs": {str(tokens): config}} (SGLang takes the entry nearest the batch's
    token count)."""
    s, dev = result["shape"], result.get("device", {}).get("name", "unknown").replace(" ", "_")
    block = f",block_shape=[{FP8_BLOCK}, {FP8_BLOCK}]" if TUNED_ARMS[arm] == "sglang_fp8" else ""
    name = f"E={s['experts']},N={s['inter']},device_name={dev},dtype=fp8_w8a8{block}.json"
    configs = {str(r["tokens"]): r[f"{arm}_config"] for r in result["rows"] if r.get(f"{arm}_config")}
    return {"file": name, "configs": configs}


def ratios(row: dict) -> dict:
    """Peer time / ours (> 1: ours faster) and ours as % of its HBM floor, for a row of times."""
    out = {}
    for ours in ("ours", "ours_rac50", "ours_rac50_static"):
        t = row.get(f"{ours}_us")
        if not t:
            continue
        for peer in ("sglang_fp8", *TUNED_ARMS, "sglang_fp8_tensor", "sglang_bf16", "torch_bf16"):
            if row.get(f"{peer}_us"):
                out[f"{ours}_vs_{peer}"] = row[f"{peer}_us"] / t
        out[f"{ours}_pct_floor"] = 100 * row["hbm_floor_us"] / t
    for peer in ("sglang_fp8", "sglang_fp8_tuned"):
        if row.get(f"{peer}_us"):
            out[f"{peer}_pct_floor"] = 100 * row["fp8_floor_us"] / row[f"{peer}_us"]
    return out


def routing_cell(row: dict) -> str:
    """The routing column: the path 'ours' takes (moe_block.routing_path) and the one its A/B arm takes."""
    path = row.get("routing", "-")
    return f"{path} (other: {row['other_routing']})" if row.get("other_routing") else path


def markdown(result: dict) -> str:
    f = bench_env.fmt
    s = result["shape"]
    lines = [
        "# Whole MoE expert block: quads W4A4 vs SGLang's fused MoE",
        "",
        *bench_env.header_lines(result),
        "",
        f"{s['experts']} experts, hidden {s['hidden']}, moe intermediate {s['inter']}, top-{s['topk']}, random",
        "routing, the same inputs for every arm; medians of CUDA-graph replays (us). Ours = moe_w4a4(impl='auto')",
        "(route, fc1, SiLU*up, fc2, top-k combine). SGLang = fused_experts as its engine runs it on Hopper",
        "(alignment, Triton GEMMs with the config it ships for the GPU or its default, fused SiLU*up, top-k",
        "sum): FP8 block [128,128] weights with per-token group activation quantization; 'fp8 tensor' =",
        "per-tensor FP8 weights as quantization='fp8' makes them.",
        f"Floor = bytes of the experts hit + bf16 activations in/out at {result['hbm_tbps']} TB/s.",
        "Ratios > 1: ours faster. Static RAC plans: fc1 from the inputs' residuals, fc2 arbitrary (time",
        "depends on the channel count only). 'ours, torch routing': the same block with the routing as a",
        "dozen torch ops (QUADS_ROUTING=torch) instead of the routing kernels, measured in the same run.",
        "'ours, no mma GEMM': the same block with the GEMMs impl='auto' ran before the decode-size GEMM",
        "(kernels/gemm_mma.py): Triton at <= 1024 grouped rows, the Gluon wgmma kernel above (A/B, same run).",
        "'ours, other routing': the same block on the routing named 'other' (routing: the path 'ours' takes,",
        "moe_block.routing_path: 'fused' = extra programs of fc1's quantization launch, 'kernel' = the one-launch",
        "routing kernel, kernels/route.py, 'chunked' = kernels/route_chunked.py's two launches, 'torch' = torch ops).",
        f"Expert weights {result.get('layout', 'row_major')} (kernels/weight_layout.py); 'ours, other layout': the",
        "same block on the other layout (A/B). 'ours, row as one tile': the same block with the activation",
        "quantization holding fc2's row of 768 as one tile padded to 1024 instead of 512 + 256 (act_quant.row_split,",
        "QUADS_ACT_SPLIT_ROW=0; A/B). '+ dyn RAC 50%, other row': the dynamic RAC block with that row held the other",
        "way than its tile holds it (row split: its tile's choice, ActQuantConfig.split_row; A/B).",
        "",
    ]
    shipped = result.get("sglang_tuned_configs") or {}
    if shipped:
        lines.append(
            "SGLang ships a tuned kernel config for this GPU and shape: "
            + ", ".join(f"{a.removeprefix('sglang_')} {'yes' if v else 'no (its default)'}" for a, v in shipped.items())
            + "."
        )
    if any(r.get(f"{a}_config") for a in TUNED_ARMS for r in result["rows"]):
        n = {a: len(peer_candidates(None, PEER_GRIDS[b])) for a, b in TUNED_ARMS.items()}
        lines.append(
            "'tuned' = that FP8 arm with the fastest of SGLang's own config and "
            f"{n['sglang_fp8_tuned']} (block) / {n['sglang_fp8_tensor_tuned']} (tensor) more of its kernel's "
            "configs at each size (`PEER_GRIDS`), the peer a user who tunes SGLang gets."
        )
    if lines[-1]:
        lines.append("")
    head = ["tokens", "experts hit", "ours", "+ dyn RAC 50%", "+ static RAC 50%", "SGLang FP8", "SGLang FP8 tuned"]
    head += [
        "SGLang FP8 tensor",
        "SGLang FP8 tensor tuned",
        "SGLang bf16",
        "torch bf16",
        "ours vs FP8",
        "ours vs FP8 tuned",
        "ours vs bf16",
    ]
    head += ["RAC50 vs FP8", "RAC50 vs FP8 tuned", "NVFP4 floor", "ours % floor", "FP8 floor", "FP8 % floor"]
    head += ["FP8 tuned % floor", "ours max err", "ours, torch routing", "ours GEMM", "ours, no mma GEMM"]
    head += ["routing", "ours, other routing", "ours, other layout", "ours, row as one tile"]
    head += ["+ dyn RAC 50%, row split", "+ dyn RAC 50%, other row"]
    rows = []
    for r in result["rows"]:
        rows.append(
            [
                str(r["tokens"]), str(r.get("active_experts", "-")), f(r.get("ours_us")), f(r.get("ours_rac50_us")),
                f(r.get("ours_rac50_static_us")), f(r.get("sglang_fp8_us")), f(r.get("sglang_fp8_tuned_us")),
                f(r.get("sglang_fp8_tensor_us")), f(r.get("sglang_fp8_tensor_tuned_us")), f(r.get("sglang_bf16_us")),
                f(r.get("torch_bf16_us")),
                f(r.get("ours_vs_sglang_fp8"), ".2f"), f(r.get("ours_vs_sglang_fp8_tuned"), ".2f"),
                f(r.get("ours_vs_sglang_bf16"), ".2f"), f(r.get("ours_rac50_vs_sglang_fp8"), ".2f"),
                f(r.get("ours_rac50_vs_sglang_fp8_tuned"), ".2f"),
                f(r.get("hbm_floor_us")), f(r.get("ours_pct_floor"), ".0f"), f(r.get("fp8_floor_us")),
                f(r.get("sglang_fp8_pct_floor"), ".0f"), f(r.get("sglang_fp8_tuned_pct_floor"), ".0f"),
                f(r.get("ours_max_abs_err"), ".2e"),
                f(r.get("ours_torch_route_us")), r.get("ours_impl", "-"), f(r.get("ours_no_mma_us")),
                routing_cell(r), f(r.get("ours_other_routing_us")),
                f(r.get("ours_other_layout_us")), f(r.get("ours_whole_row_us")),
                {True: "yes", False: "no"}.get(r.get("rac50_row_split"), "-"), f(r.get("ours_rac50_other_row_us")),
            ]
        )  # fmt: skip
    lines += bench_env.table(head, rows)
    for arm in TUNED_ARMS:
        tuned = [r for r in result["rows"] if r.get(f"{arm}_config")]
        if tuned:
            lines += ["", f"{arm}: the winning config per size (of the configs timed):", ""]
        for r in tuned:
            lines.append(
                f"- {r['tokens']} tokens ({r.get(f'{arm}_timed', '-')} timed): "
                + ", ".join(f"{k} {v}" for k, v in r[f"{arm}_config"].items())
            )
    lines += ["", "Checks (ours vs moe_w4a4(impl='reference'); every arm's relative error vs the bf16 block):", ""]
    for r in result["rows"]:
        errs = ", ".join(f"{k} {v:.3g}" for k, v in sorted(r.get("rel_err_vs_bf16", {}).items()))
        state = "PASS" if r.get("check_ok") else "FAIL"
        same = {True: "; other layout: the same bits", False: "; other layout: OTHER BITS"}.get(
            r.get("other_layout_same_bits"), ""
        )
        same += {True: "; row as one tile: the same bits", False: "; row as one tile: OTHER BITS"}.get(
            r.get("whole_row_same_bits"), ""
        )
        same += {True: "; RAC on the other row: the same bits", False: "; RAC on the other row: OTHER BITS"}.get(
            r.get("rac50_other_row_same_bits"), ""
        )
        lines.append(
            f"- {r['tokens']} tokens: {state} (rel err {f(r.get('ours_rel_err'), '.2e')}{same}); vs bf16: {errs}"
        )
        for arm, e in sorted(r.get("errors", {}).items()):
            lines.append(f"  - {arm} not measured: {e}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- inputs and arms


def fp8_block_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> FP8 E4M3 codes and fp32 dequant scales [E, N/128, K/128] (128x128 blocks)."""
    e, n, k = w.shape
    b = w.float().reshape(e, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    s = (b.abs().amax(dim=(2, 4)) / 448.0).clamp_min(1e-12)
    q = (b / s[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(e, n, k)
    return q, s.contiguous()


def fp8_tensor_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> FP8 E4M3 codes and one fp32 dequant scale per expert [E]."""
    s = (w.float().abs().amax(dim=(1, 2)) / 448.0).clamp_min(1e-12)
    return (w.float() / s[:, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn), s.contiguous()


def nvfp4_experts(w13: torch.Tensor, w2: torch.Tensor) -> moe.ExpertWeights:
    """The contract's per-tensor NVFP4 of each expert (gate and up share one global scale: one tensor)."""

    def stack(w: torch.Tensor):
        q = [nvfp4.quantize(w[e]) for e in range(w.shape[0])]
        codes = torch.stack([t.codes for t in q])
        scales = torch.stack([t.block_scales.view(torch.uint8) for t in q])
        return codes, scales, torch.stack([t.global_decode.reshape(()) for t in q]).float()

    return moe.ExpertWeights(*stack(w13), *stack(w2))


def make_inputs(shape: dict, device: str, seed: int = 0, tiled: bool = False) -> dict:
    """Random bf16 experts (distinct magnitudes) and every arm's weights made from them (ours: tiled or
    row-major NVFP4)."""
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    g = torch.Generator(device=device).manual_seed(seed)
    mag = torch.linspace(1, 4, e, device=device).view(e, 1, 1)
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) * 0.02 * mag).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g, device=device) * 0.02 * mag).bfloat16()
    return {
        "w13": w13,
        "w2": w2,
        "nvfp4": nvfp4_experts(w13, w2).as_tiled() if tiled else nvfp4_experts(w13, w2),
        "fp8_block": (*fp8_block_quant(w13), *fp8_block_quant(w2)),
        "fp8_tensor": (*fp8_tensor_quant(w13), *fp8_tensor_quant(w2)),
        "gen": g,
    }


def make_tokens(tokens: int, shape: dict, inp: dict, device: str) -> dict:
    """Activations with outlier channels, random top-k routing (int32 ids, fp32 renormalized weights)."""
    g, h, e, k = inp["gen"], shape["hidden"], shape["experts"], shape["topk"]
    x = torch.randn(tokens, h, generator=g, device=device) * torch.exp(torch.randn(h, generator=g, device=device))
    logits = torch.randn(tokens, e, generator=g, device=device)
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return {
        "x": x.bfloat16().contiguous(),
        "ids": ids.int(),
        "w": (w / w.sum(-1, keepdim=True)).float(),
        "logits": logits,
    }


def rac(shape: dict, x: torch.Tensor, static: bool, device: str) -> moe.LayerRAC:
    h, i = shape["hidden"], shape["inter"]
    n1, n2 = RACConfig(ratio=0.5).num_channels(h), RACConfig(ratio=0.5).num_channels(i)
    if not static:
        return moe.LayerRAC(moe.GemmRAC(dynamic_channels=n1), moe.GemmRAC(dynamic_channels=n2))
    p1 = RACPlan.from_scores(reference.residual_block_scores(x[:256]).sum(0).cpu(), n1)
    p2 = RACPlan.from_scores(torch.rand(i // 16, generator=torch.Generator().manual_seed(0)), n2)
    return moe.LayerRAC(moe.GemmRAC(p1), moe.GemmRAC(p2)).on(device)


def torch_bf16_block(t: dict, inp: dict, k: int) -> torch.Tensor:
    e = inp["w13"].shape[0]
    order, offs, valid = moe.route(t["ids"], e)
    xs = t["x"][order // k]
    if xs.is_cuda:
        y1 = torch._grouped_mm(xs, inp["w13"].transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(moe.gated_activation(y1), inp["w2"].transpose(-2, -1), offs=offs)
    else:  # the same math per expert (CPU dry run)
        y = torch.zeros_like(xs)
        start = 0
        for j, end in enumerate(offs.tolist()):
            if end > start:
                y[start:end] = moe.gated_activation(xs[start:end] @ inp["w13"][j].t()) @ inp["w2"][j].t()
            start = end
    return moe.combine(y, order, valid, t["w"]).to(t["x"].dtype)


class SGLangMoE:
    """SGLang's fused_experts with the process state its engine has (published ServerArgs, a one-rank
    model-parallel world): the call FusedMoE makes through its Triton runner for standard top-k output."""

    def __init__(self, shape: dict, workdir: str) -> None:
        import json

        from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
        from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
        from sglang.srt.layers.moe.topk import StandardTopKOutput
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs

        os.makedirs(workdir, exist_ok=True)
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": shape["hidden"],
            "intermediate_size": 6144, "moe_intermediate_size": shape["inter"], "num_hidden_layers": 1,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": shape["experts"],
            "num_experts_per_tok": shape["topk"], "vocab_size": 32768, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "norm_topk_prob": True, "torch_dtype": "bfloat16",
            "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
        }  # fmt: skip
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(cfg, f)
        torch.cuda.set_device(0)
        publish(ServerArgs(model_path=workdir, skip_tokenizer_init=True), role="scheduler")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="nccl"
        )
        initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1)
        self.fused_experts, self.topk_cls = fused_experts, StandardTopKOutput
        self.config = MoeRunnerConfig(
            num_experts=shape["experts"],
            num_local_experts=shape["experts"],
            hidden_size=shape["hidden"],
            intermediate_size_per_partition=shape["inter"],
            top_k=shape["topk"],
            params_dtype=torch.bfloat16,
            activation="silu",
            is_gated=True,
            inplace=False,
        )

    def fn(self, arm: str, t: dict, inp: dict, config: dict | None = None):
        """The arm's call; config: a kernel config in place of SGLang's choice (its override_config)."""
        import contextlib

        from sglang.srt.layers.moe.moe_runner.triton_utils import override_config

        topk = self.topk_cls(t["w"], t["ids"], t["logits"])
        x = t["x"]
        scope = (lambda: override_config(config)) if config else contextlib.nullcontext
        if arm == "sglang_bf16":
            w13, w2, kw = inp["w13"], inp["w2"], {}
        else:
            w13, s13, w2, s2, block = self.fp8_weights(arm, inp)
            kw = dict(use_fp8_w8a8=True, w1_scale=s13, w2_scale=s2, block_shape=block)

        def call():
            with scope():
                return self.fused_experts(x, w13, w2, topk, self.config, **kw)

        return call

    @staticmethod
    def fp8_weights(arm: str, inp: dict) -> tuple:
        """An FP8 arm's (w13, w13 scales, w2, w2 scales, block_shape): per-tensor for sglang_fp8_tensor,
        128x128 blocks for sglang_fp8."""
        per_tensor = arm == "sglang_fp8_tensor"
        return (*inp["fp8_tensor" if per_tensor else "fp8_block"], None if per_tensor else [FP8_BLOCK, FP8_BLOCK])

    @staticmethod
    def shipped_config(arm: str, inp: dict, tokens: int, topk: int) -> dict:
        """The config SGLang picks for an FP8 arm's call at this token count (its file's or its default)."""
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import try_get_optimal_moe_config

        w13, _, w2, _, block = SGLangMoE.fp8_weights(arm, inp)
        cfg = try_get_optimal_moe_config(w13.shape, w2.shape, topk, "fp8_w8a8", tokens, block_shape=block)
        return dict(cfg[0] if isinstance(cfg, tuple) else cfg)

    @staticmethod
    def tuned(arm: str, shape: dict) -> bool | None:
        """Whether SGLang has a tuned config file for this arm's kernels on this GPU."""
        try:
            from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import get_moe_configs

            dtype = None if arm == "sglang_bf16" else "fp8_w8a8"
            blk = FP8_BLOCK if arm == "sglang_fp8" else 0
            return bool(get_moe_configs(shape["experts"], shape["inter"], dtype, blk, blk))
        except Exception:
            return None


# ----------------------------------------------------------------------------- measurement


def time_us(fn, cuda: bool, rep_ms: int) -> float:
    """Median time of fn (us): CUDA-graph replays on a GPU, wall clock of eager calls on a CPU."""
    if cuda:
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[1]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def tune_peer(sgl: SGLangMoE, base: str, t: dict, inp: dict, tokens: int, shape: dict, args, log) -> tuple[dict, int]:
    """(the fastest of peer_candidates for SGLang's call of arm `base` at this size, how many were timed):
    shorter replays than the arms' (--peer-rep-ms), at most --peer-budget-s per size; failing configs skipped."""
    t0, best, timed = time.time(), None, 0
    for cfg in peer_candidates(sgl.shipped_config(base, inp, tokens, shape["topk"]), PEER_GRIDS[base]):
        if timed and time.time() - t0 > args.peer_budget_s:
            log(f"{tokens} tokens: {base} tuning stopped at its budget after {timed} configs")
            break
        try:
            us = time_us(sgl.fn(base, t, inp, config=cfg), True, args.peer_rep_ms)
        except Exception as e:  # a config the kernel cannot run here (shared memory, ...)
            log(f"{tokens} tokens: {base} config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        timed += 1
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is None:
        raise RuntimeError(f"no SGLang config of {base} ran")
    return best[1], timed


def measure(tokens: int, shape: dict, inp: dict, sgl: SGLangMoE | None, args, log) -> dict:
    cuda = args.device == "cuda"
    t = make_tokens(tokens, shape, inp, args.device)
    ids = t["ids"]
    row: dict = {"tokens": tokens, "rows": tokens * shape["topk"], "errors": {}, "rel_err_vs_bf16": {}}
    row["active_experts"] = int(torch.unique(ids).numel())
    for fmt, key in (("nvfp4", "hbm_floor_us"), ("fp8", "fp8_floor_us"), ("bf16", "bf16_floor_us")):
        row[key] = floor_us(fmt, row["active_experts"], tokens, shape, args.hbm_tbps)
    weights = inp["nvfp4"]
    rac_dyn, rac_static = rac(shape, t["x"], False, args.device), rac(shape, t["x"], True, args.device)
    if cuda:
        row["ours_impl"] = moe.gemm_impl(t["x"].device, weights, ids.numel())
    bf16_out = torch_bf16_block(t, inp, shape["topk"])

    def ours(r: moe.LayerRAC | None = None):
        r = r or moe.LayerRAC()
        return lambda: moe.moe_w4a4(t["x"], ids, t["w"], weights, r, impl="auto", check=False)

    fns = {"ours": ours(), "ours_rac50": ours(rac_dyn), "ours_rac50_static": ours(rac_static)}

    # the block (with r's RAC) with one of its switches set for the call: an A/B arm
    def ours_with_env(name: str, value: str, r: moe.LayerRAC | None = None):
        r = r or moe.LayerRAC()

        def run():
            kept = os.environ.get(name)
            os.environ[name] = value
            try:
                return moe.moe_w4a4(t["x"], ids, t["w"], weights, r, impl="auto", check=False)
            finally:
                os.environ.pop(name) if kept is None else os.environ.update({name: kept})

        return run

    # the block on the torch routing, on a routing path it does not take (moe_block.routing_path), and with
    # the activation quantization's row as one padded tile (act_quant.row_split)
    row["routing"] = moe.routing_path(ids.numel())
    fns["ours_torch_route"] = ours_with_env("QUADS_ROUTING", "torch")
    other = OTHER_ROUTING[row["routing"]]
    row["other_routing"] = other if moe.routing_fits(other, ids.numel()) else None
    if row["other_routing"]:
        fns["ours_other_routing"] = ours_with_env("QUADS_ROUTING", row["other_routing"])
    fns["ours_whole_row"] = ours_with_env("QUADS_ACT_SPLIT_ROW", "0")
    # dynamic RAC with fc2's row held the other way than its tile holds it (split_row: two pieces or one padded tile)
    tile = tile_configs.act_quant_config(ids.numel(), shape["inter"], False, True, True, args.device)
    row["rac50_row_split"] = act_quant.row_split(shape["inter"], tile.block_k, "wgmma", True, tile.split_row) > 0
    fns["ours_rac50_other_row"] = ours_with_env("QUADS_ACT_SPLIT_ROW", "0" if row["rac50_row_split"] else "1", rac_dyn)
    if "ours_other_layout" in args.arms:  # A/B of the weights' layout (kernels/weight_layout.py), made once a run
        if "nvfp4_other" not in inp:
            inp["nvfp4_other"] = weights.as_row_major() if weights.tiled else weights.as_tiled()
        other = inp["nvfp4_other"]
        fns["ours_other_layout"] = lambda: moe.moe_w4a4(t["x"], ids, t["w"], other, impl="auto", check=False)
    if cuda:  # A/B of the decode-size GEMM: the GEMMs auto ran without it
        no_mma = moe.gemm_impl(t["x"].device, weights, ids.numel(), mma=False)
        fns["ours_no_mma"] = lambda: moe.moe_w4a4(t["x"], ids, t["w"], weights, impl=no_mma, check=False)
    fns["torch_bf16"] = lambda: torch_bf16_block(t, inp, shape["topk"])
    for arm in (a for a in ARMS if a.startswith("sglang")):
        if arm not in args.arms:
            continue
        if sgl is None:
            row["errors"][arm] = "SGLang's fused MoE needs CUDA and sglang" if not cuda else "SGLang setup failed"
        elif arm in TUNED_ARMS:
            try:
                row[f"{arm}_config"], row[f"{arm}_timed"] = tune_peer(
                    sgl, TUNED_ARMS[arm], t, inp, tokens, shape, args, log
                )
                fns[arm] = sgl.fn(TUNED_ARMS[arm], t, inp, config=row[f"{arm}_config"])
            except Exception as e:
                row["errors"][arm] = f"{type(e).__name__}: {e}"[:300]
        else:
            fns[arm] = sgl.fn(arm, t, inp)
    for arm in ARMS:
        if arm not in fns or arm not in args.arms:
            continue
        try:
            y = fns[arm]()
            row["rel_err_vs_bf16"][arm] = rel_err(y, bf16_out)
            row[f"{arm}_us"] = time_us(fns[arm], cuda, args.rep_ms)
        except Exception as e:  # one arm failing must not stop the others
            row["errors"][arm] = f"{type(e).__name__}: {e}"[:300]
            log(f"FAIL {tokens} tokens {arm}: {row['errors'][arm]}")
            log(traceback.format_exc(limit=4))
    try:  # correctness, once per size: ours (auto) against the torch reference of the same math
        want = moe.moe_w4a4(t["x"], ids, t["w"], weights, impl="reference")
        got = moe.moe_w4a4(t["x"], ids, t["w"], weights, impl="auto", check=True)
        row["ours_max_abs_err"] = float((got.float() - want.float()).abs().max())
        row["ours_rel_err"] = rel_err(got, want)
        row["check_ok"] = bool(torch.isfinite(got).all()) and row["ours_rel_err"] < args.check_rtol
        if "ours_other_layout" in fns:  # (made only when asked for) a layout moves bytes, not bits
            row["other_layout_same_bits"] = torch.equal(got, fns["ours_other_layout"]())
            row["check_ok"] &= row["other_layout_same_bits"]
        if "ours_whole_row" in args.arms:  # the padded tile is the same arithmetic
            row["whole_row_same_bits"] = torch.equal(got, fns["ours_whole_row"]())
            row["check_ok"] &= row["whole_row_same_bits"]
        if "ours_rac50_other_row" in args.arms:  # so is dynamic RAC on the other row layout
            row["rac50_other_row_same_bits"] = torch.equal(fns["ours_rac50"](), fns["ours_rac50_other_row"]())
            row["check_ok"] &= row["rac50_other_row_same_bits"]
    except Exception as e:
        row["errors"]["check"] = f"{type(e).__name__}: {e}"[:300]
        row["check_ok"] = False
    row.update(ratios(row))
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--out", help="results folder (default: $OUT, else benchmarks/results; dry run: the workdir)")
    ap.add_argument(
        "--hbm-tbps", type=float, default=None, help="HBM bandwidth of the floor (default: by GPU name, HBM_TBPS)"
    )
    ap.add_argument("--rep-ms", type=int, default=60, help="replay time per measurement (triton do_bench_cudagraph)")
    ap.add_argument("--peer-rep-ms", type=int, default=20, help="replay time per config of the FP8 peer's tuning")
    ap.add_argument("--peer-budget-s", type=float, default=60.0, help="seconds of FP8 peer tuning per size")
    ap.add_argument("--check-rtol", type=float, default=5e-3, help="ours vs reference relative error bound")
    ap.add_argument(
        "--layout", choices=("tiled", "row_major"), default="tiled", help="the NVFP4 expert weights' layout of 'ours'"
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, reference path, no SGLang")
    ap.add_argument("--workdir", default="/tmp/quads_bench_moe_block", help="scratch (SGLang's model config)")
    args = ap.parse_args(argv)
    try:
        args.tokens = [int(v) for v in args.tokens.split(",") if v]
    except ValueError:
        ap.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if not args.tokens or min(args.tokens) < 1:
        ap.error("--tokens: at least one positive token count")
    args.arms = [a for a in args.arms.split(",") if a]
    bad = sorted(set(args.arms) - set(ARMS))
    if bad:
        ap.error(f"--arms: unknown {bad} (known: {', '.join(ARMS)})")
    args.device = "cpu" if args.dry_run else "cuda"
    if args.out is None:
        results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        args.out = os.path.join(args.workdir, "out") if args.dry_run else os.environ.get("OUT") or results
    if args.hbm_tbps is None:  # the GPU's own, H200's without one (dry run)
        name = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else "H200"
        args.hbm_tbps = next((v for k, v in HBM_TBPS.items() if k in name), HBM_TBPS["H200"])
    if args.dry_run and args.tokens == list(TOKENS):
        args.tokens = [4, 16]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_moe_block: needs a CUDA GPU (or --dry-run on a CPU)", file=sys.stderr)
        return 2
    shape = TINY if args.dry_run else SHAPE

    def log(msg: str) -> None:
        print(msg, flush=True)

    if os.environ.pop("SGLANG_MOE_CONFIG_DIR", None) is not None:  # "shipped" must mean SGLang's own files
        log("SGLANG_MOE_CONFIG_DIR of this shell ignored: the SGLang arms start from the configs SGLang ships")
    result = {**bench_env.header(), "shape": shape, "hbm_tbps": args.hbm_tbps, "dry_run": args.dry_run, "rows": []}
    result["layout"] = args.layout
    t0 = time.time()
    inp = make_inputs(shape, args.device, tiled=args.layout == "tiled")
    sgl = None
    if args.device == "cuda" and any(a.startswith("sglang") for a in args.arms):
        try:
            sgl = SGLangMoE(shape, args.workdir)
            result["sglang_tuned_configs"] = {a: SGLangMoE.tuned(a, shape) for a in SHIPPED_CONFIG_ARMS}
        except Exception as e:
            result["sglang_setup_error"] = f"{type(e).__name__}: {e}"[:500]
            log(f"FAIL SGLang setup: {result['sglang_setup_error']}\n{traceback.format_exc(limit=6)}")
    for tokens in args.tokens:
        row = measure(tokens, shape, inp, sgl, args, log)
        result["rows"].append(row)
        state = "PASS" if row["check_ok"] and not row["errors"] else "FAIL"
        log(
            f"{state} {tokens} tokens: ours {bench_env.fmt(row.get('ours_us'))} us, SGLang FP8 "
            f"{bench_env.fmt(row.get('sglang_fp8_us'))} us (tuned {bench_env.fmt(row.get('sglang_fp8_tuned_us'))}), "
            f"bf16 {bench_env.fmt(row.get('sglang_bf16_us'))} us, "
            f"floor {row['hbm_floor_us']:.1f} us, rel err {bench_env.fmt(row.get('ours_rel_err'), '.1e')}"
            + (f", errors {sorted(row['errors'])}" if row["errors"] else "")
        )
        log("  times (us): " + json.dumps({k: round(v, 1) for k, v in row.items() if k.endswith("_us") and v}))
    result["seconds"] = time.time() - t0
    bench_env.write_json(os.path.join(args.out, "moe_block.json"), result)
    for arm, name in TUNED_FILES.items():
        if any(r.get(f"{arm}_config") for r in result["rows"]):
            bench_env.write_json(os.path.join(args.out, name), tuned_config_file(result, arm))
    md = markdown(result)
    bench_env.write_text(os.path.join(args.out, "moe_block.md"), md)
    print(md)
    ok = all(r["check_ok"] for r in result["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
