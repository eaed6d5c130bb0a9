"""The trainer of `quads rl`: a Megatron-Core GPTModel (Qwen3-MoE shape) with the Transformer Engine spec and
TEGroupedMLP experts on a GPU (the local spec with SequentialMLP experts on a CPU), mixed-precision Adam,
the SFT warm-up and the GRPO step.

QAT arms patch Megatron the way a user does: ``quads_megatron.apply(config)`` before the model is built.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import torch

from quads_megatron.rl import grpo
from quads_megatron.rl.spec import ModelSpec

#: the trainer's QUADS config of the QAT arms (routed experts, fc1 and fc2, per-tensor global scales)
QAT_CONFIG = {"trainer": {"experts": ["routed"]}}


def setup_megatron(seed: int) -> str:
    """A one-process Megatron world; returns the trainer's device ('cuda' or 'cpu')."""
    from quads_megatron.rl.megatron_model import init_megatron

    if torch.cuda.is_available():
        from quads_megatron.rl.megatron_model import te_skip_reason

        reason = te_skip_reason()
        if reason:  # the GPU trainer is the Transformer Engine spec
            raise RuntimeError(f"the GPU trainer {reason}")
    init_megatron(seed)
    if torch.cuda.is_available():
        return "cuda"
    from megatron.core import tensor_parallel

    # CPU stand-in for megatron's CUDA RNG tracker fork (dropout is 0: nothing is drawn under it)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return "cpu"


def build_model(model: ModelSpec, device: str, seed: int) -> torch.nn.Module:
    """The GPTModel of model's shape: TE spec in BF16 on CUDA, local spec in FP32 on CPU; Megatron's init."""
    from quads_megatron.rl.megatron_model import build_gpt_model

    torch.manual_seed(seed)
    cuda = device == "cuda"
    m = build_gpt_model(
        model.hf_config(),
        spec="te" if cuda else "local",
        dtype=torch.bfloat16 if cuda else torch.float32,
        device=device,
        perform_initialization=True,
        moe_token_dispatcher_type="alltoall" if cuda else "allgather",
    )
    return m.train()


class MasterAdam:
    """Adam on FP32 master copies of the model's parameters (BF16 on a GPU), written back after each
    step; global gradient-norm clipping. Torch's Adam steps the masters, so the QAT weight cache sees
    the step (its optimizer hook) and the in-place copy (parameter versions)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        self.params = params
        self.masters = [p.detach().float().clone() for p in params]
        self.opt = torch.optim.Adam(self.masters, lr=lr, betas=betas, eps=1e-8)

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def step(self, grad_clip: float) -> float:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters, grad_clip))
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)
                p.grad, m.grad = None, None
        return norm

    def state_dict(self) -> dict:
        return {"masters": [m.detach().cpu() for m in self.masters], "adam": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"], strict=True):
                m.copy_(saved)
                p.copy_(saved)
        self.opt.load_state_dict(state["adam"])


def answer_logprobs(
    model: torch.nn.Module, seqs: torch.Tensor, prompt_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp fp32 [B, A], entropy fp32 [B, A], argmax hits bool [B, A]) of the answer tokens
    seqs[:, prompt_len:] under model."""
    x = seqs[:, :-1]
    pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand_as(x)
    mask = None  # causal from the layer spec; megatron's CPU fallback builds its default mask on CUDA
    if x.device.type == "cpu":
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)[None, None]
    logits = model(x, pos, attention_mask=mask)[:, prompt_len - 1 :].float()
    lp = torch.log_softmax(logits, dim=-1)
    target = seqs[:, prompt_len:]
    logp = lp.gather(-1, target[..., None])[..., 0]
    entropy = -(lp.exp() * lp).sum(-1)
    return logp, entropy, lp.argmax(-1) == target


def chunks(n: int, size: int) -> Iterator[slice]:
    for i in range(0, n, size):
        yield slice(i, min(n, i + size))


class Trainer:
    """One arm's (or the SFT warm-up's) model and optimizer."""

    def __init__(self, model: ModelSpec, device: str, seed: int, lr: float, qat: bool = False) -> None:
        if qat:
            import quads_megatron

            quads_megatron.apply(QAT_CONFIG)  # before the model is built, as a user's script does
        self.device, self.qat = device, qat
        self.model = build_model(model, device, seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = MasterAdam(self.params, lr)

    def close(self) -> None:
        if self.qat:
            import quads_megatron

            quads_megatron.remove()

    # -- state

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Model parameters by name (a checkpoint's); the optimizer's masters follow."""
        named = dict(self.model.named_parameters())
        missing = sorted(set(named) - set(weights))
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[0]}")
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(weights[n])
        self.opt = MasterAdam(self.params, self.opt.opt.defaults["lr"])

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}

    def state_dict(self) -> dict:
        return {"weights": self.weights(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.load_weights(state["weights"])
        self.opt.load_state_dict(state["opt"])

    # -- steps

    def sft_step(self, prompts: torch.Tensor, truth: torch.Tensor, micro_batch: int, grad_clip: float) -> dict:
        """One supervised step on (prompt, answer) pairs: mean NLL of the answer tokens."""
        seqs = torch.cat([prompts, truth], 1).to(self.device)
        total, loss_sum, right = seqs.numel() - prompts.numel(), 0.0, 0.0
        for sl in chunks(len(seqs), micro_batch):
            logp, _, hit = answer_logprobs(self.model, seqs[sl], prompts.shape[1])
            loss = -logp.sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
            right += float(hit.sum())
        norm = self.opt.step(grad_clip)
        return {"sft/loss": loss_sum, "sft/token_accuracy": right / total, "sft/grad_norm": norm}

    def grpo_step(
        self,
        seqs: torch.Tensor,
        prompt_len: int,
        logp_rollout: torch.Tensor,
        advantages: torch.Tensor,
        clip: float,
        tis_cap: float,
        micro_batch: int,
        grad_clip: float,
    ) -> tuple[dict, torch.Tensor]:
        """One GRPO update on the rollout's sequences [B, P + A]; returns (metrics, the trainer's
        logprobs of the sampled tokens before the update, fp32 [B, A] on CPU)."""
        seqs = seqs.to(self.device)
        denom = seqs.shape[0] * (seqs.shape[1] - prompt_len)
        sums: dict[str, float] = {}
        old, entropy = [], 0.0
        for sl in chunks(len(seqs), micro_batch):
            logp, ent, _ = answer_logprobs(self.model, seqs[sl], prompt_len)
            loss, s = grpo.policy_loss(logp, logp, logp_rollout[sl], advantages[sl], clip, tis_cap, denom)
            loss.backward()
            for k, v in s.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            old.append(logp.detach().float().cpu())
            entropy += float(ent.detach().sum())
        metrics = {k: v / denom for k, v in sums.items()}
        metrics["train/entropy_loss"] = entropy / denom
        metrics["train/grad_norm"] = self.opt.step(grad_clip)
        return metrics, torch.cat(old)


# ----------------------------------------------------------------------------- HF checkpoint for the engine


def export_hf(model: torch.nn.Module, model_spec: ModelSpec, path: str) -> str:
    """The model as an HF Qwen3-MoE checkpoint (BF16 safetensors + config.json) at path: the tensors the
    live sync sends, so the engine starts from the trainer's weights and names."""
    from safetensors.torch import save_file

    from quads_megatron.rl.megatron_model import hf_expert_weights_bf16, hf_non_expert_weights

    cfg = model_spec.hf_config()
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    tensors = dict(hf_non_expert_weights(named, cfg)) | dict(hf_expert_weights_bf16(named, model_spec.experts))
    os.makedirs(path, exist_ok=True)
    save_file(
        {n: t.to(torch.bfloat16).cpu().contiguous() for n, t in tensors.items()},
        os.path.join(path, "model.safetensors"),
        {"format": "pt"},
    )
    with open(os.path.join(path, "config.json"), "w") as f:  # the keys of the hub's Qwen3-MoE config.json
        json.dump(cfg, f, indent=1)
    return path
