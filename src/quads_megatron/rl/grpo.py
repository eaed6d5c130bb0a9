"""GRPO math: group-normalized advantages, the clipped policy loss with optional truncated importance
sampling (TIS), and the rollout-vs-trainer mismatch metrics under the names slime and verl log them.

Metric names (every tensor is [B, T]: B sampled answers of T tokens, all tokens valid):

* ``train/train_rollout_logprob_abs_diff`` (slime, loss.py): mean over samples of the per-sample mean
  |logp_train - logp_rollout|.
* ``train/train_rollout_logprob_abs_diff_max``: the max of the same over tokens (the paper's "max gap";
  slime logs no max, the name extends slime's).
* ``training/rollout_probs_diff_mean`` / ``_max`` / ``_std`` (verl, metrics of calculate_log_probs):
  |p_rollout - p_train| in probability space, mean / max / std over tokens.
* ``rollout_corr/kl`` (verl, rollout_corr_helper.compute_offpolicy_metrics): mean(logp_rollout -
  logp_train); ``rollout_corr/k3_kl``: mean(exp(r) - r - 1), r = logp_train - logp_rollout clamped to
  [-20, 20] as verl does.
* ``train/tis``, ``train/tis_clipfrac``, ``train/tis_abs`` (slime's vanilla TIS): mean of
  pi_train/pi_rollout, fraction of tokens whose weight the cap changed, mean |ratio - 1|.
* ``train/pg_loss``, ``train/pg_clipfrac``, ``train/ppo_kl`` (slime).
"""

from __future__ import annotations

import torch

SAFETY_BOUND = 20.0  # verl clamps the log ratio of k3_kl to this
ADV_EPS = 1e-6


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO advantages [B]: (r - mean of its group) / (std of its group + eps); groups are consecutive."""
    r = rewards.float().view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + ADV_EPS)).view(-1)


def mismatch_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor) -> dict[str, float]:
    """The rollout-vs-trainer metrics of one step (see the module docstring) from [B, T] logprobs."""
    lt, lr = logp_train.detach().double(), logp_rollout.detach().double().to(logp_train.device)
    diff = (lt - lr).abs()
    probs = (lr.exp() - lt.exp()).abs()
    log_ratio = (lt - lr).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "train/train_rollout_logprob_abs_diff": float(diff.mean(1).mean()),
        "train/train_rollout_logprob_abs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(probs.mean()),
        "training/rollout_probs_diff_max": float(probs.max()),
        "training/rollout_probs_diff_std": float(probs.std()) if probs.numel() > 1 else 0.0,
        "rollout_corr/kl": float((lr - lt).mean()),
        "rollout_corr/k3_kl": float((log_ratio.exp() - log_ratio - 1).mean()),
    }


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    clip: float,
    tis_cap: float = 0.0,
    denom: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped GRPO loss of [B, T] token logprobs (logp with grad), summed over tokens / denom
    (default: the token count), so micro-batch losses add up to the batch's token mean.

    logp_old: the trainer's logprobs of the sampled tokens before the update; logp_rollout: the
    engine's. tis_cap > 0: each token's loss is weighted by min(pi_old / pi_rollout, tis_cap) (slime's
    vanilla TIS with tis_clip_low 0). Returns (loss, metric sums over tokens, keyed by the slime name).
    """
    adv = advantages.to(logp.device).float().unsqueeze(1)
    log_ratio = logp - logp_old.detach()
    ratio = log_ratio.exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - clip, 1 + clip)
    pg = torch.maximum(pg1, pg2)
    sums = {
        "train/pg_clipfrac": (pg2 > pg1).float().sum().detach(),
        "train/ppo_kl": (-log_ratio).sum().detach(),
    }
    if tis_cap > 0:
        tis = (logp_old.detach() - logp_rollout.to(logp.device)).exp()
        w = tis.clamp(max=tis_cap)
        pg = pg * w
        sums |= {
            "train/tis": tis.sum(),
            "train/tis_clipfrac": (w != tis).float().sum(),
            "train/tis_abs": (tis - 1).abs().sum(),
        }
    sums["train/pg_loss"] = pg.sum().detach()
    loss = pg.sum() / (denom if denom is not None else pg.numel())
    return loss, sums
