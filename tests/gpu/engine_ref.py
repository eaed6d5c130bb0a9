"""Torch reference of a served Qwen3-MoE checkpoint, for the SGLang engine tests (CPU or GPU).

HF transformers' Qwen3MoeForCausalLM with every MoE block's forward replaced: routing as SGLang's TopK
does it (fp32 softmax of the bf16 router logits, top-k, renormalized), then one of two expert functions:
``Bf16Experts`` (the HF weights; bf16 after each GEMM and after SiLU(gate) * up, as SGLang's fused MoE
rounds) or ``W4A4Experts`` (quads_megatron's ``moe_w4a4(impl="reference")`` on the tensors a `quads convert`
output holds, with the RAC and activation-scale settings its quantization config selects, read the way
the quads_nvfp4 method reads them). Greedy decoding and per-token logprobs run without a KV cache.
``calibrate`` records RAC statistics from the bf16 forward (each routed row fc1 quantizes, and
SiLU(gate) * up of each expert) and writes what `quads convert --rac-plans/--input-amax` takes.
"""

from __future__ import annotations

import json
import os

import torch

from quads_megatron import nvfp4
from quads_megatron.config import RACConfig, load_config
from quads_megatron.rollout import moe_block
from quads_megatron.rollout.calibration import RACCalibrator, save_calibration
from quads_megatron.rollout.rac_plan import RACPlan

MODES = ("dynamic", "static", "off")
#: rollout settings each mode's checkpoint carries (None: no quads block; the method defaults to dynamic RAC 50%)
MODE_ROLLOUT: dict[str, dict | None] = {
    "dynamic": None,
    "static": {"activation_scale": "static", "rac": {"selection": "static"}},
    "off": {"rac": {"enabled": False}},
}


def moe_prefix(layer: int) -> str:
    """The FusedMoE prefix SGLang gives a Qwen3-MoE layer's experts (RAC plan and calibration names)."""
    return f"model.layers.{layer}.mlp.experts"


# ----------------------------------------------------------------------------- checkpoints


def convert(src: str, dst: str, mode: str, calib: dict[str, str] | None = None) -> None:
    """`quads convert src dst --verify` (the CLI entry point, in process) with the mode's rollout settings
    (a quads YAML beside dst) and, for 'static', the calibration's plans and input amaxes."""
    from quads_megatron import cli

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    args = ["convert", src, dst, "--verify", "--quiet"]
    rollout = MODE_ROLLOUT[mode]
    if rollout is not None:
        import yaml

        cfg_path = dst.rstrip("/") + ".quads.yaml"
        with open(cfg_path, "w") as f:
            yaml.safe_dump({"rollout": rollout}, f)
        args += ["--quads-config", cfg_path]
    if mode == "static":
        if not calib:
            raise ValueError("mode 'static' needs the calibration files (calibrate())")
        args += ["--rac-plans", calib["rac_plans"], "--input-amax", calib["input_amax"]]
    rc = cli.main(args)
    if rc != 0:
        raise RuntimeError(f"quads {' '.join(args)} exited with {rc}")


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the .safetensors files in a checkpoint directory."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def quads_block(path: str) -> dict:
    """The ``quads`` block of a converted checkpoint's hf_quant_config.json ({} when absent)."""
    with open(os.path.join(path, "hf_quant_config.json")) as f:
        return json.load(f).get("quads", {})


def expert_weights(tensors: dict, layer: int, num_experts: int, device: str) -> moe_block.ExpertWeights:
    """One layer's experts stacked from the converted ModelOpt tensors (gate rows, then up rows)."""
    p = moe_prefix(layer)

    def get(e: int, proj: str, kind: str) -> torch.Tensor:
        return tensors[f"{p}.{e}.{proj}.{kind}"]

    experts = range(num_experts)
    w13 = torch.stack([torch.cat([get(e, "gate_proj", "weight"), get(e, "up_proj", "weight")]) for e in experts])
    s13 = torch.stack(
        [torch.cat([get(e, "gate_proj", "weight_scale"), get(e, "up_proj", "weight_scale")]) for e in experts]
    )
    g13 = torch.stack([get(e, "gate_proj", "weight_scale_2").reshape(()) for e in experts]).float()
    w2 = torch.stack([get(e, "down_proj", "weight") for e in experts])
    s2 = torch.stack([get(e, "down_proj", "weight_scale") for e in experts])
    g2 = torch.stack([get(e, "down_proj", "weight_scale_2").reshape(()) for e in experts]).float()
    return moe_block.ExpertWeights(
        w13.to(device), s13.view(torch.uint8).to(device), g13.to(device),
        w2.to(device), s2.view(torch.uint8).to(device), g2.to(device),
    )  # fmt: skip


def static_amax(tensors: dict, layer: int, num_experts: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1, fc2) static activation amax as the serving method derives it: from the largest calibrated
    ModelOpt input_scale over the layer's experts (gate and up for fc1)."""
    p = moe_prefix(layer)
    s13 = max(
        float(tensors[f"{p}.{e}.{proj}.input_scale"]) for e in range(num_experts) for proj in ("gate_proj", "up_proj")
    )
    s2 = max(float(tensors[f"{p}.{e}.down_proj.input_scale"]) for e in range(num_experts))
    return tuple(nvfp4.amax_from_input_scale(torch.tensor(s, dtype=torch.float32)).to(device) for s in (s13, s2))


def layer_rac(quads: dict, layer: int, hidden: int, inter: int) -> tuple[moe_block.LayerRAC, bool]:
    """(RAC of layer, static activation scale?) from a checkpoint's quads block, defaults as the method's."""
    rollout = load_config({"rollout": quads["rollout"]} if "rollout" in quads else None).rollout
    rac = rollout.rac
    static_scale = rollout.activation_scale == "static"
    if not rac.enabled or rac.ratio == 0:
        return moe_block.LayerRAC(), static_scale
    if rac.selection == "dynamic":
        gemm = moe_block.GemmRAC
        return moe_block.LayerRAC(
            gemm(dynamic_channels=rac.num_channels(hidden)), gemm(dynamic_channels=rac.num_channels(inter))
        ), static_scale
    plans = quads["rac_plans"][moe_prefix(layer)]
    return moe_block.LayerRAC(
        moe_block.GemmRAC(RACPlan(torch.tensor(plans["w13"], dtype=torch.long), hidden)),
        moe_block.GemmRAC(RACPlan(torch.tensor(plans["w2"], dtype=torch.long), inter)),
    ), static_scale


# ----------------------------------------------------------------------------- the model


def load_model(path: str, device: str, attention: str = "sdpa"):
    """The HF bf16 checkpoint as a transformers Qwen3MoeForCausalLM in eval mode on device. attention:
    transformers' attn_implementation ("eager" gives the same math with other roundings: the perturbed
    reference that measures how much a mode amplifies non-expert numeric differences)."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attention)
    return model.to(device).eval()


def route(x: torch.Tensor, router_weight: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] bf16 -> (ids int64 [T, k], weights fp32 [T, k]): fp32 softmax of the bf16 logits, top-k,
    renormalized (SGLang's TopK with renormalize, Qwen3-MoE's norm_topk_prob)."""
    probs = torch.softmax(torch.nn.functional.linear(x, router_weight).float(), dim=-1)
    w, ids = probs.topk(topk, dim=-1)
    return ids, w / w.sum(-1, keepdim=True)


def patch_moe(model, experts) -> None:
    """Route every MoE block of model through experts(layer, x [T, H], ids, weights) -> [T, H]."""
    for i, layer in enumerate(model.model.layers):
        block = layer.mlp

        def forward(hidden: torch.Tensor, i: int = i, block=block) -> torch.Tensor:
            b, s, h = hidden.shape
            x = hidden.reshape(-1, h)
            ids, w = route(x, block.gate.weight, block.gate.top_k)
            return experts(i, x, ids, w).reshape(b, s, h)

        block.forward = forward


class Bf16Experts:
    """The HF model's own bf16 experts, grouped by expert; records calibration statistics when given a
    RACCalibrator (fc1: each routed row; fc2: SiLU(gate) * up)."""

    def __init__(self, model, calibrator: RACCalibrator | None = None) -> None:
        self.model, self.calibrator = model, calibrator

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ex = self.model.model.layers[layer].mlp.experts
        e_count = ex.gate_up_proj.shape[0]
        order, offs, valid = moe_block.route(ids, e_count)
        rows = x[order // ids.shape[1]]
        gated = torch.zeros(rows.shape[0], ex.down_proj.shape[2], dtype=x.dtype, device=x.device)
        y = torch.zeros_like(rows)
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                h = moe_block.gated_activation(rows[start:end] @ ex.gate_up_proj[e].t())
                gated[start:end] = h
                y[start:end] = h @ ex.down_proj[e].t()
            start = end
        if self.calibrator is not None:
            self.calibrator.observe(f"{moe_prefix(layer)}.w13", rows)
            self.calibrator.observe(f"{moe_prefix(layer)}.w2", gated)
        return moe_block.combine(y, order, valid, w).to(x.dtype)


class W4A4Experts:
    """moe_w4a4(impl='reference') on a converted checkpoint's NVFP4 tensors, with its quads settings."""

    def __init__(self, converted: str, num_layers: int, num_experts: int, device: str) -> None:
        tensors = read_tensors(converted)
        quads = quads_block(converted)
        self.layers = []
        for i in range(num_layers):
            weights = expert_weights(tensors, i, num_experts, device)
            rac, static_scale = layer_rac(quads, i, weights.hidden, weights.intermediate)
            amax = static_amax(tensors, i, num_experts, device) if static_scale else (None, None)
            self.layers.append((weights, rac, amax))

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        weights, rac, amax = self.layers[layer]
        return moe_block.moe_w4a4(x, ids, w, weights, rac, amax, impl="reference")


# ----------------------------------------------------------------------------- decoding and scores


@torch.no_grad()
def token_logprobs(model, seqs: torch.Tensor) -> torch.Tensor:
    """log p(seqs[:, t] | seqs[:, :t]) for t >= 1: fp32 [B, L-1] (full forward, no cache)."""
    logits = model(input_ids=seqs, use_cache=False).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, 1:, None])[..., 0]


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation [B, new_tokens] of equal-length prompts [B, P] (recomputed each step)."""
    seq = prompts
    for _ in range(new_tokens):
        logits = model(input_ids=seq, use_cache=False).logits[:, -1].float()
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompts.shape[1] :]


@torch.no_grad()
def calibrate(model, seqs: torch.Tensor, out_dir: str, ratio: float = 0.5) -> dict[str, str]:
    """RAC plans (ratio of K) and input amaxes from a bf16 forward over seqs; the files quads convert takes."""
    cal = RACCalibrator()
    patch_moe(model, Bf16Experts(model, cal))
    try:
        model(input_ids=seqs, use_cache=False)
    finally:
        patch_moe(model, Bf16Experts(model))
    num_experts = model.config.num_experts
    return save_calibration(out_dir, cal, RACConfig(ratio=ratio).num_channels, num_experts)


def gap(a, b) -> dict[str, float]:
    """Mean and max |a - b| of two equally shaped score arrays."""
    d = (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs()
    return {"mean": float(d.mean()), "max": float(d.max())}


def agreement(a, b) -> dict[str, float]:
    """Greedy token agreement of two [B, N] token arrays: fraction of identical positions, and the mean
    fraction of each row before its first difference."""
    x, y = torch.as_tensor(a), torch.as_tensor(b)
    same = x == y
    first_diff = torch.where(same.all(1), same.shape[1], (~same).int().argmax(1))
    return {"identical": float(same.float().mean()), "prefix": float(first_diff.float().mean() / same.shape[1])}
