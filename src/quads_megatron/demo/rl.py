"""CPU RL demo: does NVFP4 rollout drift from the trainer, and does QUADS close the gap?

A tiny GPT whose MoE layers are real megatron-core MoELayers (SequentialMLP experts; attention
and embeddings are plain torch, since megatron's GPTModel needs a CUDA RNG tracker) learns
single-digit addition ("3+4=07") with GRPO. After a shared supervised warm-up, three arms train
from the same weights with the same seeds:

* bf16:  fp32 trainer, rollout engine in bf16 (the engine-drift floor).
* naive: fp32 trainer, rollout experts W4A4 NVFP4 (weights quantized at sync, no RAC).
* quads: trainer with asymmetric NVFP4 QAT on the experts (quads_megatron.apply), rollout
         experts W4A4 + RAC as the QUADS config's rollout section says: rac.selection dynamic
         (per token, rac.ratio of K) or static (per-layer plans calibrated with rac.metric at
         the start of the arm), activation_scale dynamic or static (calibrated amax).

The rollout engine reuses the trainer's non-expert modules under bf16 autocast and runs every
expert GEMM through quads_megatron.rollout.reference (the reference path of the rollout kernels),
with the expert weights synced each step through quads_megatron.checkpoint.megatron_expert_tensors
(the live-sync path). Logged per step: reward, mean/max |logp_rollout - logp_train| over sampled
tokens, and KL(rollout || train) estimated on the samples.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import quads_megatron
from quads_megatron import checkpoint, nvfp4
from quads_megatron.config import NVFP4Config, QuadsConfig, RolloutConfig, load_config
from quads_megatron.errors import QuadsConfigError
from quads_megatron.rollout import calibration, rac_plan, reference

VOCAB = [*"0123456789", "+", "="]
PLUS, EQ = 10, 11
PROMPT_LEN, ANSWER_LEN = 4, 2
ARMS = ("bf16", "naive", "quads")
HEADS = 4  # attention heads of every block (and of the MoE layers' TransformerConfig)


@dataclass
class DemoArgs:
    steps: int = 150
    sft_steps: int = 80  # a partial warm-up, so RL has something to learn
    prompts: int = 16
    group: int = 8
    lr: float = 5e-4  # RL learning rate (the warm-up uses 2x)
    seed: int = 0
    hidden: int = 64
    ffn: int = 64
    experts: int = 8
    topk: int = 2
    layers: int = 2
    clip: float = 0.2
    tis_cap: float = 0.0  # truncated importance sampling cap on pi_train/pi_rollout (0: off)
    out: str = "runs/demo"
    config: str | None = None

    def __post_init__(self) -> None:
        """ValueError naming the flag of the first bad value (main turns it into an argparse error)."""
        for name in ("steps", "prompts", "experts", "topk", "layers", "hidden", "ffn"):
            _check(name, getattr(self, name) >= 1, "must be >= 1")
        _check("sft_steps", self.sft_steps >= 0, "must be >= 0")
        _check("group", self.group >= 2, "must be >= 2 (GRPO normalizes rewards within a group)")
        _check("seed", self.seed >= 0, "must be >= 0")
        _check("lr", math.isfinite(self.lr) and self.lr > 0, "must be a finite number > 0")
        _check("clip", math.isfinite(self.clip) and 0 < self.clip < 1, "must be in (0, 1)")
        _check("tis_cap", math.isfinite(self.tis_cap) and self.tis_cap >= 0, "must be >= 0 (0: off)")
        _check("topk", self.topk <= self.experts, f"must be <= --experts ({self.experts})")
        _check(
            "hidden",
            self.hidden % 16 == 0 and self.hidden % HEADS == 0,
            f"must be a multiple of 16 (NVFP4 blocks of fc1's K) and of the {HEADS} attention heads",
        )
        _check("ffn", self.ffn % 16 == 0, "must be a multiple of 16 (NVFP4 blocks of fc2's K)")
        _check("out", bool(self.out), "must be a directory path")


def _check(name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')} {what}")


# ----------------------------------------------------------------------------- model


class Block(torch.nn.Module):
    def __init__(self, mcfg, layer_number: int, hidden: int, heads: int = HEADS) -> None:
        super().__init__()
        from quads_megatron.demo.cpu_megatron import build_moe_layer

        self.ln1 = torch.nn.RMSNorm(hidden)
        self.attn = torch.nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = torch.nn.RMSNorm(hidden)
        self.moe = build_moe_layer(mcfg, seed=1000 + layer_number, layer_number=layer_number)

    def forward(self, x: torch.Tensor, moe_fn=None) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = self.ln2(x).transpose(0, 1).contiguous()  # megatron layout [S, B, H]
        y = self.moe(h)[0] if moe_fn is None else moe_fn(self.moe, h)
        return x + y.transpose(0, 1).to(x.dtype)


class TinyMoEGPT(torch.nn.Module):
    def __init__(self, a: DemoArgs) -> None:
        super().__init__()
        from quads_megatron.demo.cpu_megatron import moe_config

        mcfg = moe_config(num_experts=a.experts, hidden=a.hidden, ffn=a.ffn, topk=a.topk, activation_func=F.silu)
        torch.manual_seed(a.seed)
        self.embed = torch.nn.Embedding(len(VOCAB), a.hidden)
        self.pos = torch.nn.Embedding(PROMPT_LEN + ANSWER_LEN, a.hidden)
        self.blocks = torch.nn.ModuleList([Block(mcfg, i + 1, a.hidden) for i in range(a.layers)])
        self.norm = torch.nn.RMSNorm(a.hidden)
        self.head = torch.nn.Linear(a.hidden, len(VOCAB))

    def forward(self, tokens: torch.Tensor, moe_fn=None) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for b in self.blocks:
            x = b(x, moe_fn)
        return self.head(self.norm(x)).float()


# ----------------------------------------------------------------------------- task


def make_prompts(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randint(0, 10, (n,), generator=gen)
    b = torch.randint(0, 10, (n,), generator=gen)
    prompts = torch.stack([a, torch.full_like(a, PLUS), b, torch.full_like(a, EQ)], 1)
    s = a + b
    return prompts, torch.stack([s // 10, s % 10], 1)


def rewards(answers: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    right = (answers == truth).float()
    return torch.where(right.all(1), torch.ones(len(answers)), 0.25 * right.sum(1))


# ----------------------------------------------------------------------------- rollout engine


class RolloutEngine:
    """Samples answers with the rollout numerics of one arm (see module docstring).

    rollout: the QUADS config's rollout section; the quads arm follows it (RAC on/off, ratio,
    dynamic or static selection, metric of the static plans, dynamic or static activation scale),
    the naive arm runs plain W4A4 with per-token activation scales, the bf16 arm no NVFP4 at all.
    nvfp4_config: the config's NVFP4 variant, which the quads arm syncs weights and quantizes
    activations with (its trainer fake-quantizes with it); the naive arm is plain NVFP4.
    """

    def __init__(
        self,
        model: TinyMoEGPT,
        mode: str,
        rollout: RolloutConfig | None = None,
        nvfp4_config: NVFP4Config | None = None,
    ) -> None:
        if mode not in ARMS:
            raise ValueError(f"mode must be one of {ARMS}, got {mode!r}")
        self.model, self.mode, self.rollout = model, mode, rollout or RolloutConfig()
        self.nvfp4_config = (nvfp4_config or NVFP4Config()) if mode == "quads" else NVFP4Config()
        self.weights: dict[tuple[int, int], tuple[nvfp4.NVFP4Tensor, nvfp4.NVFP4Tensor]] = {}
        self.plans: dict[tuple[int, str], rac_plan.RACPlan] = {}  # (layer, 'fc1'|'fc2') -> static RAC plan
        self.amax: dict[tuple[int, str], torch.Tensor] = {}  # (layer, 'fc1'|'fc2') -> static activation amax
        self._calibrator: calibration.RACCalibrator | None = None  # set while calibrate() runs a batch

    @property
    def needs_calibration(self) -> bool:
        rac = self.rollout.rac
        static_rac = rac.enabled and rac.ratio > 0 and rac.selection == "static"
        return self.mode == "quads" and (static_rac or self.rollout.activation_scale == "static")

    def sync_weights(self) -> None:
        """Live sync: Megatron expert params -> ModelOpt NVFP4 tensors -> per-expert fc1/fc2."""
        if self.mode == "bf16":
            return
        named = []
        for li, blk in enumerate(self.model.blocks):
            for name, p in blk.moe.named_parameters():
                named.append((f"decoder.layers.{li}.mlp.{name}", p.detach()))
        n_local = self.model.blocks[0].moe.experts.num_local_experts
        t = dict(
            checkpoint.megatron_expert_tensors(named, 0, n_local, hf_prefix="layers", nvfp4_config=self.nvfp4_config)
        )
        get = lambda m: nvfp4.from_modelopt(t[f"{m}.weight"], t[f"{m}.weight_scale"], t[f"{m}.weight_scale_2"])
        for li in range(len(self.model.blocks)):
            for e in range(n_local):
                base = f"layers.{li}.mlp.experts.{e}"
                gate, up = get(f"{base}.gate_proj"), get(f"{base}.up_proj")
                fc1 = nvfp4.NVFP4Tensor(
                    torch.cat([gate.codes, up.codes]),
                    torch.cat([gate.block_scales, up.block_scales]),
                    gate.global_decode,
                )
                self.weights[(li, e)] = (fc1, get(f"{base}.down_proj"))

    def calibrate(self, tokens: torch.Tensor) -> None:
        """Static RAC plans (rac.metric statistic) and static activation amax per layer and linear,
        from one batch; only what the quads arm's config asks for."""
        if not self.needs_calibration:
            return
        cal = calibration.RACCalibrator(self.rollout.rac.metric, self.nvfp4_config.activations)
        self._calibrator = cal
        try:
            with torch.no_grad():
                self.forward(tokens)
        finally:
            self._calibrator = None
        key = lambda k: (int(k.split("/")[0]), k.split("/")[1])  # "layer/linear", see _linear
        rac = self.rollout.rac
        if rac.enabled and rac.ratio > 0 and rac.selection == "static":
            self.plans = {key(k): p for k, p in cal.plans(rac.num_channels).items()}
        if self.rollout.activation_scale == "static":
            self.amax = {key(k): torch.tensor(a) for k, a in cal.amax.items()}

    def _linear(self, x: torch.Tensor, w: nvfp4.NVFP4Tensor, li: int, which: str) -> torch.Tensor:
        if self._calibrator is not None:
            self._calibrator.observe(f"{li}/{which}", x)
        plan, channels, static_amax = None, 0, None
        if self.mode == "quads":
            rac = self.rollout.rac
            if rac.enabled and rac.ratio > 0:
                if rac.selection == "static":
                    plan = self.plans.get((li, which))  # None while calibrating
                else:
                    channels = rac.num_channels(x.shape[1])
            static_amax = self.amax.get((li, which))
        qa = reference.quantize_activation(x.float(), plan, static_amax, channels, self.nvfp4_config.activations)
        return reference.w4a4_linear_reference(qa, w)

    def _moe(self, li: int):
        def moe_fn(moe, h: torch.Tensor) -> torch.Tensor:
            if self.mode == "bf16":
                return moe(h)[0]
            s, b, hid = h.shape
            probs, routing_map = moe.router(h)
            x = h.reshape(-1, hid).float()
            out = torch.zeros_like(x)
            for e in range(routing_map.shape[1]):
                idx = routing_map[:, e].nonzero().squeeze(1)
                if idx.numel() == 0:
                    continue
                fc1, fc2 = self.weights[(li, e)]
                h1 = self._linear(x[idx], fc1, li, "fc1")
                gate, up = h1.chunk(2, dim=-1)
                cfg = moe.config  # the same GLU as megatron's MLP; probs are applied before fc2 there too
                act = cfg.activation_func(gate) * (up + getattr(cfg, "glu_linear_offset", 0.0))
                act = act * probs[idx, e].float().unsqueeze(-1)
                out[idx] += self._linear(act, fc2, li, "fc2")
            return out.reshape(s, b, hid)

        return moe_fn

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = self.model.embed(tokens) + self.model.pos(torch.arange(tokens.shape[1]))
            for li, blk in enumerate(self.model.blocks):
                x = blk(x, self._moe(li))
            return self.model.head(self.model.norm(x)).float()

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ANSWER_LEN tokens; returns (answers [B, 2], rollout logprobs [B, 2])."""
        seq, logps = prompts, []
        for _ in range(ANSWER_LEN):
            logp = F.log_softmax(self.forward(seq)[:, -1, :10], dim=-1)  # answers are digits
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            logps.append(logp.gather(1, tok))
            seq = torch.cat([seq, tok], 1)
        return seq[:, PROMPT_LEN:], torch.cat(logps, 1)


def train_logprobs(model: TinyMoEGPT, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    seq = torch.cat([prompts, answers], 1)
    logits = model(seq[:, :-1])[:, PROMPT_LEN - 1 :, :10]
    return F.log_softmax(logits, -1).gather(2, answers.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------- training


def sft(model: TinyMoEGPT, a: DemoArgs, gen: torch.Generator, log) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=a.lr * 2)
    for step in range(a.sft_steps):
        prompts, truth = make_prompts(128, gen)
        loss = -train_logprobs(model, prompts, truth).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == a.sft_steps - 1:
            log(f"sft step {step:4d} loss {loss.item():.3f}")


def run_arm(arm: str, model: TinyMoEGPT, a: DemoArgs, qcfg: QuadsConfig, progress) -> list[dict]:
    gen = torch.Generator().manual_seed(a.seed + 1)
    sample_gen = torch.Generator().manual_seed(a.seed + 2)
    if arm == "quads":
        quads_megatron.apply(qcfg, model=model)
    try:
        engine = RolloutEngine(model, arm, qcfg.rollout, qcfg.nvfp4)
        engine.sync_weights()
        engine.calibrate(torch.cat(make_prompts(256, torch.Generator().manual_seed(a.seed + 3)), 1))
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)
        rows = []
        for step in range(a.steps):
            prompts, truth = make_prompts(a.prompts, gen)
            prompts = prompts.repeat_interleave(a.group, 0)
            truth = truth.repeat_interleave(a.group, 0)
            engine.sync_weights()
            answers, logp_roll = engine.generate(prompts, sample_gen)
            r = rewards(answers, truth)
            grouped = r.view(a.prompts, a.group)
            adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)
            logp_train = train_logprobs(model, prompts, answers)
            gap = logp_roll - logp_train.detach()
            ratio = torch.exp(logp_train - logp_roll)
            if a.tis_cap > 0:  # truncated importance sampling composes with QUADS
                ratio = ratio * torch.clamp(ratio.detach(), max=a.tis_cap) / ratio.detach()
            pg = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - a.clip, 1 + a.clip) * adv)
            loss = -pg.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rows.append(
                {
                    "arm": arm,
                    "step": step,
                    "reward": r.mean().item(),
                    "mean_abs_gap": gap.abs().mean().item(),
                    "max_abs_gap": gap.abs().max().item(),
                    "kl_rollout_train": gap.mean().item(),
                }
            )
            progress(arm, step)
        return rows
    finally:
        if arm == "quads":
            quads_megatron.remove()


def summarize(rows: list[dict], tail: int) -> list[dict]:
    out = []
    for arm in ARMS:
        rs = [r for r in rows if r["arm"] == arm]
        if not rs:
            continue
        last = rs[-tail:]
        first = rs[:tail]
        out.append(
            {
                "arm": arm,
                "first_reward": sum(r["reward"] for r in first) / len(first),
                "final_reward": sum(r["reward"] for r in last) / len(last),
                "mean_abs_gap": sum(r["mean_abs_gap"] for r in rs) / len(rs),
                "max_abs_gap": max(r["max_abs_gap"] for r in rs),
                "kl_rollout_train": sum(r["kl_rollout_train"] for r in rs) / len(rs),
            }
        )
    return out


PANELS = (  # (metric, title, y-axis label)
    ("reward", "Reward (exact answer = 1)", "mean reward per RL step"),
    ("mean_abs_gap", "Rollout-trainer gap (mean)", "mean |logp_rollout - logp_train|"),
    ("max_abs_gap", "Rollout-trainer gap (max)", "max |logp_rollout - logp_train|"),
)


def make_figure(rows: list[dict]):
    """One panel per PANELS entry, one line per arm; titled and labelled on both axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(14, 4))
    for ax, (key, title, ylabel) in zip(axes, PANELS, strict=True):
        for arm in ARMS:
            rs = [r for r in rows if r["arm"] == arm]
            ax.plot([r["step"] for r in rs], [r[key] for r in rs], label=arm)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
    axes[0].legend(title="arm")
    fig.suptitle("QUADS CPU RL demo: bf16 rollout vs naive NVFP4 vs QUADS (QAT + RAC)")
    fig.tight_layout()
    return fig


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib.pyplot as plt

        fig = make_figure(rows)
    except ImportError:
        return False
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def rollout_label(rollout: RolloutConfig) -> str:
    """What the quads arm's rollout ran, e.g. 'RAC dynamic, ratio 0.5; activation scale dynamic'."""
    rac = rollout.rac
    if not rac.enabled or rac.ratio == 0:
        what = "RAC off"
    elif rac.selection == "static":
        what = f"RAC static (calibrated, metric {rac.metric}), ratio {rac.ratio}"
    else:
        what = f"RAC dynamic, ratio {rac.ratio}"
    return f"{what}; activation scale {rollout.activation_scale}"


def _md_row(cells: list[str]) -> str:
    """A markdown table row; '|' inside a cell is escaped so the row keeps its columns."""
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def summary_table(summary: list[dict]) -> list[str]:
    """The markdown table of summarize()'s rows."""
    header = ["arm", "reward first -> last", "mean |logp_rollout - logp_train|", "max |gap|", "KL(rollout||train)"]
    lines = [_md_row(header), _md_row(["---"] * len(header))]
    for s in summary:
        lines.append(
            _md_row(
                [
                    s["arm"],
                    f"{s['first_reward']:.3f} -> {s['final_reward']:.3f}",
                    f"{s['mean_abs_gap']:.4f}",
                    f"{s['max_abs_gap']:.3f}",
                    f"{s['kl_rollout_train']:.5f}",
                ]
            )
        )
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoArgs()
    for name, val in vars(d).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(val, bool):
            p.add_argument(flag, action="store_true", default=val)
        else:
            p.add_argument(flag, type=type(val) if val is not None else str, default=val)
    p.set_defaults(_demo_parser=p)  # main() reports bad values through this parser


def parse_args(ns: argparse.Namespace) -> tuple[DemoArgs, QuadsConfig]:
    """DemoArgs and the QUADS config from parsed arguments; a bad value is an argparse error
    (usage + one line naming the flag, exit status 2) when ns came from add_arguments' parser."""
    parser = getattr(ns, "_demo_parser", None)
    try:
        a = DemoArgs(**{k: getattr(ns, k) for k in vars(DemoArgs())})
        return a, load_config(a.config)
    except (ValueError, QuadsConfigError) as e:
        msg = f"--config {e}" if isinstance(e, QuadsConfigError) else str(e)
        if parser is None:
            raise
        parser.error(msg)
        raise  # parser.error exits


def main(ns: argparse.Namespace | None = None) -> int:
    if ns is None:
        p = argparse.ArgumentParser(description=__doc__)
        add_arguments(p)
        ns = p.parse_args()
    a, qcfg = parse_args(ns)
    # megatron-core warns at import that TE/Apex are absent: expected on a CPU machine
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")
    from quads_megatron.demo.cpu_megatron import init_distributed, install_cpu_shims_for_megatron

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    install_cpu_shims_for_megatron()
    init_distributed()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    total = a.steps * len(ARMS)
    done = [0]

    tty = sys.stderr.isatty()

    def progress(arm: str, step: int) -> None:
        done[0] += 1
        if not tty:  # a log file gets one line per arm, not a redrawn bar
            if step + 1 == a.steps:
                log(f"{arm}: {a.steps} RL steps done")
            return
        width = 30
        fill = int(width * done[0] / total)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {arm:5s} step {step + 1}/{a.steps}")
        if done[0] == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    torch.manual_seed(a.seed)
    model = TinyMoEGPT(a)
    sft(model, a, torch.Generator().manual_seed(a.seed), log)
    start = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    rows: list[dict] = []
    for arm in ARMS:
        model.load_state_dict(start, strict=False)
        rows += run_arm(arm, model, a, qcfg, progress)
    csv_path = os.path.join(a.out, "demo_metrics.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    summary = summarize(rows, tail=max(1, a.steps // 5))
    lines = summary_table(summary)
    by = {s["arm"]: s for s in summary}
    verdict = [f"quads rollout: {rollout_label(qcfg.rollout)}"]
    if {"bf16", "naive", "quads"} <= by.keys():
        floor, naive, quads = by["bf16"]["mean_abs_gap"], by["naive"]["mean_abs_gap"], by["quads"]["mean_abs_gap"]
        verdict.append(
            f"mean gap: bf16 floor {floor:.4f}, naive NVFP4 {naive:.4f} ({naive / max(floor, 1e-12):.1f}x floor), "
            f"QUADS {quads:.4f} ({quads / max(floor, 1e-12):.1f}x floor)"
        )
        if not quads < naive:
            verdict.append(
                "QUADS did NOT reduce the gap below naive NVFP4 in this run: investigate before trusting it."
            )
    text = "\n".join(lines + [""] + [f"- {v}" for v in verdict]) + "\n"
    with open(os.path.join(a.out, "demo_summary.md"), "w") as f:
        f.write(text)
    plotted = plot(rows, os.path.join(a.out, "demo_gaps.png"))
    print(text)
    log(f"wrote {csv_path}{', demo_gaps.png' if plotted else ''} and demo_summary.md in {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
