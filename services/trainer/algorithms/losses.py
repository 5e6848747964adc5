"""Token log-probs and entropy, the PPO-clip policy loss, the SFT loss, and slime's loss reducers.

Per-token functions return [B, T] tensors; reducers turn them into the step's scalar (`sum_of_sample_mean`,
`sum_of_token`); `policy_loss_function` / `sft_loss_function` compose them the way slime's `loss.py` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.trainer.algorithms.kl import compute_approx_kl

Reducer = Callable[[torch.Tensor], torch.Tensor]


def token_log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(target) and the entropy of π, with π = softmax(logits / temperature) (slime's --rollout-temperature).

    logits: [B, T, V], already aligned so that logits[:, t] predicts targets[:, t]; targets: [B, T] int64.
    Returns (log_probs [B, T], entropy [B, T]) in float32, entropy = -Σ_v π_v log π_v.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_softmax = F.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
    return log_probs, entropy


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, *,
                eps_clip: float, eps_clip_high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (slime's `compute_policy_loss`); eps_clip_high > eps_clip is DAPO clip-higher.

    All inputs [B, T]. ppo_kl = old - new, ratio = exp(new - old);
    loss = max(-ratio·A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high)·A).
    Returns (loss [B, T], {"clipfrac": 1.0 where the clipped term is the larger, "ppo_kl": old - new}), the
    metrics detached. PPO: https://arxiv.org/abs/1707.06347; DAPO: https://arxiv.org/abs/2503.14476
    """
    ppo_kl = old_log_probs - log_probs
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = torch.gt(clipped, unclipped).float()
    return loss, {"clipfrac": clipfrac.detach(), "ppo_kl": ppo_kl.detach()}


def sft_loss(log_probs: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token: -log π(target). [B, T] -> [B, T]."""
    return -log_probs


def sum_of_sample_mean(x: torch.Tensor, loss_mask: torch.Tensor, *, denominators: torch.Tensor) -> torch.Tensor:
    """slime's default reducer: Σ_i Σ_t x[i, t]·m[i, t] / max(den_i, 1). x, loss_mask: [B, T]; denominators: [B].

    den_i is the loss-mask total of sample i's rollout, fixed for the whole step, so the caller dividing by the
    step's sample count gets the mean over samples of each sample's token mean, however the step is micro-batched.
    """
    return ((x * loss_mask).sum(dim=-1) / denominators.to(x.dtype).clamp_min(1)).sum()


def sum_of_token(x: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Reducer of --calculate-per-token-loss: Σ_i Σ_t x[i, t]·m[i, t]. x, loss_mask: [B, T].

    The caller divides by the step's token count Σ_i max(Σ_t m[i, t], 1), giving a global token mean.
    """
    return (x * loss_mask).sum()


def policy_loss_function(*, log_probs: torch.Tensor, entropy: torch.Tensor, old_log_probs: torch.Tensor,
                         advantages: torch.Tensor, reduce: Reducer, eps_clip: float, eps_clip_high: float,
                         entropy_coef: float = 0.0, ref_log_probs: torch.Tensor | None = None,
                         kl_loss_coef: float = 0.0, kl_loss_type: str = "k1",
                         rollout_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's policy objective: loss = pg_loss - entropy_coef·entropy_loss + kl_loss_coef·kl_loss.

    Tensors are [B, T] response-aligned; `reduce` maps a [B, T] per-token tensor to this micro-batch's share of the
    step's scalar. ref_log_probs (given under use_kl_loss) adds kl_loss; its gradient flows only when
    kl_loss_coef != 0, and entropy's only when entropy_coef != 0. rollout_log_probs adds the mismatch metric
    train_rollout_logprob_abs_diff = reduce(|old - rollout|). Returns (loss, detached scalar metrics).
    """
    per_token, token_metrics = policy_loss(log_probs, old_log_probs, advantages, eps_clip=eps_clip,
                                           eps_clip_high=eps_clip_high)
    pg_loss = reduce(per_token)
    entropy_loss = reduce(entropy if entropy_coef != 0.0 else entropy.detach())
    loss = pg_loss - entropy_coef * entropy_loss
    metrics = {"pg_loss": pg_loss, "pg_clipfrac": reduce(token_metrics["clipfrac"]),
               "ppo_kl": reduce(token_metrics["ppo_kl"]), "entropy_loss": entropy_loss}
    if ref_log_probs is not None:
        with_grad = kl_loss_coef != 0.0
        kl = compute_approx_kl(log_probs if with_grad else log_probs.detach(), ref_log_probs,
                               kl_loss_type=kl_loss_type)
        kl_loss = reduce(kl)
        if with_grad:
            loss = loss + kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    if rollout_log_probs is not None:
        metrics["train_rollout_logprob_abs_diff"] = reduce((old_log_probs - rollout_log_probs).abs())
    metrics["loss"] = loss
    return loss, {k: v.detach() for k, v in metrics.items()}


def sft_loss_function(*, log_probs: torch.Tensor, reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's SFT objective: loss = reduce(-log π(target)) over the response tokens. Returns (loss, {"loss"})."""
    loss = reduce(sft_loss(log_probs))
    return loss, {"loss": loss.detach()}
