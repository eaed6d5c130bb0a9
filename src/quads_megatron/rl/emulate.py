"""A CPU stand-in for the SGLang rollout engine (`quads rl --dry-run`, the CPU tests). Not an engine: it
takes the same sync stream and runs the same rollout math in torch, so a study runs end to end without a GPU.

* The "engine" is a second Megatron GPTModel (local spec) that receives the live-sync tensors by their HF
  names: BF16 non-expert weights (rounded to BF16, as the engine holds them) and the experts, packed
  NVFP4 (NVFP4 arms) or BF16. It runs under CPU BF16 autocast.
* On NVFP4 arms every expert GEMM is replaced by the torch reference of the rollout kernels
  (quads_megatron.rollout.reference): per-token NVFP4 activations, dynamic RAC of the arm's ratio, the
  synced codes and scales, exact products. (Megatron applies routing probs before fc2; SGLang's fused MoE
  after it: the stand-in quantizes fc2's input as Megatron forms it.)
* Sampling at temperature 1 with a seeded generator (saved with the run, so a resumed run repeats).
"""

from __future__ import annotations

import re
import time

import torch

from quads_megatron import nvfp4
from quads_megatron.config import RACConfig
from quads_megatron.rl.rollout import sync_stream
from quads_megatron.rl.spec import ArmSpec, StudySpec
from quads_megatron.rollout import reference

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")


def local_expert_linears(model: torch.nn.Module):
    """(layer index, expert index, 'fc1'|'fc2', module) of every SequentialMLP expert linear."""
    for li, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts
        for e, mlp in enumerate(getattr(experts, "local_experts", [])):
            yield li, e, "fc1", mlp.linear_fc1
            yield li, e, "fc2", mlp.linear_fc2


class EmulatedRollout:
    """The CPU stand-in (see the module docstring); the interface of rollout.SglangRollout."""

    def __init__(self, arm: ArmSpec, spec: StudySpec) -> None:
        from quads_megatron.integrations.megatron import qat
        from quads_megatron.rl.trainer import build_model

        t0 = time.perf_counter()
        self.arm, self.spec = arm, spec
        self.model = build_model(spec.model, "cpu", spec.seed)
        qat.leave_unquantized(self.model)  # the engine's weights are what the sync sends, never QAT'd here
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.gen = torch.Generator().manual_seed(spec.seed + 2)
        self.weights: dict[tuple[int, int, str], nvfp4.NVFP4Tensor] = {}
        self.handles = []
        if arm.rollout == "nvfp4":
            rac = RACConfig(enabled=arm.rac_ratio > 0, ratio=arm.rac_ratio)
            for li, e, fc, mod in local_expert_linears(self.model):
                self.handles.append(mod.register_forward_hook(self._hook(li, e, fc, rac)))
        self.start_s = time.perf_counter() - t0

    def _hook(self, li: int, e: int, fc: str, rac: RACConfig):
        def hook(module, args, output):
            x = args[0]
            if x.numel() == 0:
                return None
            flat = x.reshape(-1, x.shape[-1]).float()
            qa = reference.quantize_activation(flat, None, None, rac.num_channels(flat.shape[1]))
            y = reference.w4a4_linear_reference(qa, self.weights[(li, e, fc)])
            out = output[0] if isinstance(output, tuple) else output
            y = y.to(out.dtype).reshape(*x.shape[:-1], y.shape[-1])
            return (y, *output[1:]) if isinstance(output, tuple) else y

        return hook

    def sync(self, model: torch.nn.Module) -> dict[str, float]:
        """The live-sync stream of the trainer's weights, loaded by HF name (packed experts dequantized
        into the dense copy, kept as NVFP4 for the reference GEMMs)."""
        from quads_megatron.rl.megatron_model import load_hf_weights

        t0 = time.perf_counter()
        packed = self.arm.rollout == "nvfp4"
        hf, parts, nbytes = {}, {}, 0
        for name, t in sync_stream(model, self.spec.model, packed):
            nbytes += t.numel() * t.element_size()
            m = _EXPERT.match(name) if packed else None
            if m is None:
                hf[name] = t.to(torch.bfloat16)  # what a BF16 engine holds
            else:
                parts.setdefault((int(m[1]), int(m[2]), m[3]), {})[m[4]] = t
        for (li, e, proj), p in parts.items():
            q = nvfp4.from_modelopt(p["weight"], p["weight_scale"], p["weight_scale_2"])
            hf[f"model.layers.{li}.mlp.experts.{e}.{proj}.weight"] = q.dequantize()
            parts[(li, e, proj)] = q
        for (li, e, proj), q in parts.items():
            if proj == "down_proj":
                self.weights[(li, e, "fc2")] = q
            elif proj == "gate_proj":  # fc1 = [gate; up], one global scale (the sync quantized them together)
                up = parts[(li, e, "up_proj")]
                cat = [torch.cat([q.codes, up.codes]), torch.cat([q.block_scales, up.block_scales])]
                self.weights[(li, e, "fc1")] = nvfp4.NVFP4Tensor(*cat, q.global_decode)
        load_hf_weights(self.model, hf, self.spec.model.hf_config())
        return {"perf/sync_prepare_s": time.perf_counter() - t0, "perf/sync_send_s": 0.0, "perf/sync_mb": nbytes / 1e6}

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, answer_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """answer_len tokens per prompt sampled at temperature 1 (full recompute per token, no KV cache)."""
        seq, logps = prompts.clone(), []
        for _ in range(answer_len):
            pos = torch.arange(seq.shape[1]).unsqueeze(0).expand_as(seq)
            mask = torch.triu(torch.ones(seq.shape[1], seq.shape[1], dtype=torch.bool), diagonal=1)[None, None]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = self.model(seq, pos, attention_mask=mask)[:, -1]
            lp = torch.log_softmax(logits.float(), dim=-1)
            tok = torch.multinomial(lp.exp(), 1, generator=self.gen)
            logps.append(lp.gather(1, tok))
            seq = torch.cat([seq, tok], 1)
        return seq[:, prompts.shape[1] :], torch.cat(logps, 1)

    def rng_state(self) -> dict:
        return {"gen": self.gen.get_state()}

    def set_rng_state(self, state: dict) -> None:
        if "gen" in state:
            self.gen.set_state(state["gen"])

    def close(self) -> None:
        for h in self.handles:
            h.remove()
