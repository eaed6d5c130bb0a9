"""What a `quads rl` study runs: the model, the task, the arms and the RL settings, validated.

An arm is one RL run from the shared SFT checkpoint; its name says what differs:

* ``bf16``: BF16 trainer, BF16 rollout engine (the engine-drift floor).
* ``naive``: BF16 trainer, NVFP4 W4A4 rollout (weights quantized at sync, no RAC).
* ``quads``: asymmetric NVFP4 QAT trainer, W4A4 rollout with dynamic RAC 50%.
* ``racR``: QAT trainer, W4A4 rollout with dynamic RAC R% (``rac0`` = QAT without RAC).
* any name + ``-tis``: the same with truncated importance sampling (cap 2.0) in the loss.
* any name + ``@LR`` (e.g. ``bf16@1e-4``): the same with its own GRPO learning rate instead of the
  study's ``--lr``, from the same SFT weights: a learning-rate sweep in one study. The paper's claims
  compare the arms without one.

Presets: ``main`` = bf16,naive,quads; ``sweep`` = rac0,rac12.5,rac25,quads,rac100 (quads is RAC 50%);
``all`` = main + sweep + naive-tis.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

TIS_CAP = 2.0  # slime --tis-clip / verl rollout_is_threshold default
ARM_PRESETS = {
    "main": ("bf16", "naive", "quads"),
    "sweep": ("rac0", "rac12.5", "rac25", "quads", "rac100"),
}
ARM_PRESETS["all"] = (*ARM_PRESETS["main"], *ARM_PRESETS["sweep"][:3], "rac100", "naive-tis")
_RAC = re.compile(r"^rac(\d+(?:\.\d+)?)$")
_LR = re.compile(r"^\d+(?:\.\d+)?(?:e-?\d+)?$")  # an arm's learning rate: 1e-4, 0.0002, 5e-05


class SpecError(ValueError):
    """A bad study setting; the message starts with the flag that sets it."""


def _check(flag: str, ok: bool, what: str) -> None:
    if not ok:
        raise SpecError(f"--{flag} {what}")


@dataclass(frozen=True)
class ArmSpec:
    name: str
    rollout: str  # 'bf16' | 'nvfp4'
    qat: bool
    rac_ratio: float  # fraction of K compensated (nvfp4 rollouts)
    tis_cap: float = 0.0  # 0: no TIS
    lr: float | None = None  # the arm's own GRPO learning rate (None: the study's)

    @classmethod
    def parse(cls, name: str) -> ArmSpec:
        base, at, lr_text = name.partition("@")
        lr = _arm_lr(name, lr_text) if at else None
        base, tis = (base[:-4], TIS_CAP) if base.endswith("-tis") else (base, 0.0)
        if base == "bf16":
            return cls(name, "bf16", False, 0.0, tis, lr)
        if base == "naive":
            return cls(name, "nvfp4", False, 0.0, tis, lr)
        if base == "quads":
            return cls(name, "nvfp4", True, 0.5, tis, lr)
        m = _RAC.match(base)
        if m and float(m[1]) <= 100:
            return cls(name, "nvfp4", True, float(m[1]) / 100, tis, lr)
        raise SpecError(
            f"--arms: unknown arm {name!r} (bf16, naive, quads, racR with R in [0, 100], each optionally "
            f"with -tis and @LR; presets {', '.join(ARM_PRESETS)})"
        )

    def learning_rate(self, study_lr: float) -> float:
        return study_lr if self.lr is None else self.lr

    @property
    def label(self) -> str:
        if self.rollout == "bf16":
            what = "BF16 trainer, BF16 rollout"
        elif not self.qat:
            what = "BF16 trainer, NVFP4 W4A4 rollout (no RAC)"
        else:
            what = f"NVFP4 QAT trainer, W4A4 rollout + RAC {self.rac_ratio * 100:g}%"
        what += f", TIS cap {self.tis_cap:g}" if self.tis_cap else ""
        return what + (f", GRPO lr {self.lr:g}" if self.lr is not None else "")


def _arm_lr(name: str, text: str) -> float:
    """The learning rate after an arm name's '@' (a finite number > 0, e.g. 1e-4)."""
    try:
        lr = float(text)
    except ValueError:
        lr = float("nan")
    if not (math.isfinite(lr) and lr > 0) or not _LR.match(text):
        raise SpecError(f"--arms: arm {name!r}: the learning rate after '@' must be a number > 0, like 1e-4")
    return lr


def parse_arms(text: str) -> tuple[str, ...]:
    """Comma-separated arm names and presets (``main@1e-4``: each of main's arms at lr 1e-4) -> arm names in
    order, without repeats."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        preset, at, lr = part.partition("@")  # a preset with @LR: each of its arms with that lr
        for name in (f"{n}{at}{lr}" for n in ARM_PRESETS[preset]) if preset in ARM_PRESETS else (part,):
            ArmSpec.parse(name)
            if name not in names:
                names.append(name)
    _check("arms", bool(names), "needs at least one arm")
    return tuple(names)


@dataclass(frozen=True)
class ModelSpec:
    """A Qwen3-MoE-shaped model (every layer MoE): what Megatron trains and SGLang serves."""

    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 32
    topk: int = 4
    moe_ffn: int = 256
    vocab: int = 1024

    def validate(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "topk", "moe_ffn"):
            _check(name.replace("_", "-"), getattr(self, name) >= 1, "must be >= 1")
        _check("topk", self.topk <= self.experts, f"must be <= --experts ({self.experts})")
        _check("hidden", self.hidden % 16 == 0, "must be a multiple of 16 (NVFP4 blocks of fc1's K)")
        _check("moe-ffn", self.moe_ffn % 16 == 0, "must be a multiple of 16 (NVFP4 blocks of fc2's K)")
        _check("heads", self.heads % self.kv_heads == 0, "must be a multiple of the KV heads")
        _check("vocab", self.vocab >= 32, "must be >= 32 (the task uses 13 token ids)")

    def hf_config(self) -> dict:
        """config.json of the Qwen3MoeForCausalLM with this shape (what SGLang loads)."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": self.hidden,
            "intermediate_size": 4 * self.hidden,
            "moe_intermediate_size": self.moe_ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.experts,
            "num_experts_per_tok": self.topk,
            "vocab_size": self.vocab,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
        }

    def parameters(self) -> int:
        """Parameter count (experts, attention, norms, embeddings)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        experts = self.experts * 3 * h * self.moe_ffn + self.experts * h
        attn = h * (q + 2 * kv) + q * h + 2 * self.head_dim
        return self.layers * (experts + attn + 2 * h) + 2 * self.vocab * h + h


MODEL_PRESETS = {
    "h200": ModelSpec(),  # ~108M parameters: 8 layers, 32 experts top-4
    "smoke": ModelSpec(layers=2, experts=16),  # the GPU engine tests' layer shape, 2 layers
    "tiny": ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4, topk=2, moe_ffn=32, vocab=32),
}


@dataclass(frozen=True)
class StudySpec:
    """Everything that fixes a study's numbers; a run directory refuses to resume under another."""

    arms: tuple[str, ...] = ARM_PRESETS["all"]
    model: ModelSpec = field(default_factory=ModelSpec)
    task: str = "add"  # 'add' | 'sort'
    digits: int = 8
    steps: int = 150  # RL steps per arm
    prompts: int = 32  # prompts per step
    group: int = 8  # samples per prompt (GRPO group)
    lr: float = 5e-5
    clip: float = 0.2
    grad_clip: float = 1.0
    micro_batch: int = 256  # sequences per forward/backward
    sft_steps: int = 1500  # SFT warm-up: at most this many steps ...
    sft_target: float = 0.6  # ... or until teacher-forced answer-token accuracy reaches this
    sft_batch: int = 256
    sft_lr: float = 1e-3
    seed: int = 0
    engine: str = "sglang"  # 'sglang' | 'emulate' (the CPU stand-in)
    mem_fraction: float = 0.2  # SGLang mem_fraction_static (the trainer shares the GPU)
    cuda_graph: bool = False
    ckpt_every: int = 50
    attribution: bool = True

    def validate(self) -> StudySpec:
        self.model.validate()
        for a in self.arms:
            ArmSpec.parse(a)
        _check("arms", len(self.arms) == len(set(self.arms)), "lists an arm twice")
        _check("task", self.task in ("add", "sort"), f"must be 'add' or 'sort', got {self.task!r}")
        _check("digits", 1 <= self.digits <= 30, "must be in [1, 30]")
        for name in ("steps", "prompts", "micro_batch", "sft_batch", "ckpt_every"):
            _check(name.replace("_", "-"), getattr(self, name) >= 1, "must be >= 1")
        _check("sft-steps", self.sft_steps >= 0, "must be >= 0")
        _check("group", self.group >= 2, "must be >= 2 (GRPO normalizes rewards within a group)")
        _check("seed", self.seed >= 0, "must be >= 0")
        for name in ("lr", "sft_lr", "grad_clip"):
            v = getattr(self, name)
            _check(name.replace("_", "-"), math.isfinite(v) and v > 0, "must be a finite number > 0")
        _check("clip", math.isfinite(self.clip) and 0 < self.clip < 1, "must be in (0, 1)")
        _check("sft-target", 0 < self.sft_target <= 1, "must be in (0, 1]")
        _check("engine", self.engine in ("sglang", "emulate"), "must be 'sglang' or 'emulate'")
        _check("mem-fraction", 0 < self.mem_fraction < 0.9, "must be in (0, 0.9)")
        return self

    def arm(self, name: str) -> ArmSpec:
        return ArmSpec.parse(name)

    @property
    def batch(self) -> int:
        return self.prompts * self.group

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StudySpec:
        d = dict(d)
        d["model"] = ModelSpec(**d["model"])
        d["arms"] = tuple(d["arms"])
        return cls(**d)

    def fingerprint(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def first_difference(a: dict, b: dict, prefix: str = "") -> str | None:
    """The first key (dotted) whose value differs between two spec dicts, with both values."""
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            d = first_difference(va, vb, f"{prefix}{k}.")
            if d:
                return d
        elif va != vb and not (isinstance(va, (list, tuple)) and list(va) == list(vb or [])):
            return f"{prefix}{k}: {vb!r} here, {va!r} in the run directory"
    return None
