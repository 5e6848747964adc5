"""Token log-probs and entropy, the policy losses (PPO clip + dual clip, GSPO, CISPO, TIS), the value, SFT losses, and
slime's loss reducers.

Per-token functions return [B, T] tensors; reducers turn them into the step's scalar (`sum_of_sample_mean`,
`sum_of_token`); `policy_loss_function` / `value_loss_function` / `sft_loss_function` compose them the way slime's
`loss.py` does. Formulas follow slime's `ppo_utils.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.trainer.algorithms.kl import compute_approx_kl

Reducer = Callable[[torch.Tensor], torch.Tensor]


def token_log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                                with_entropy: bool = True,
                                entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target) and the entropy of π, with π = softmax(logits / temperature) (slime's --rollout-temperature).

    logits: [B, T, V], already aligned so that logits[:, t] predicts targets[:, t]; targets: [B, T] int64.
    Returns (log_probs [B, T], entropy [B, T] or None) in float32, entropy = -Σ_v π_v log π_v. entropy_grad False:
    the entropy is a metric only, computed without keeping its [B, T, V] intermediates for a backward.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_softmax = F.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
    return log_probs, entropy


def compute_policy_loss(ppo_kl: torch.Tensor, advantages: torch.Tensor, *, eps_clip: float, eps_clip_high: float,
                        eps_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (slime's `compute_policy_loss`); eps_clip_high > eps_clip is DAPO clip-higher.

    ppo_kl = log π_old - log π (per token, or GSPO's per-sequence value broadcast), advantages: [B, T].
    ratio = exp(-ppo_kl); loss = max(-ratio·A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high)·A); with dual clip
    (eps_clip_c > 1), where A < 0 the loss becomes min(loss, -eps_clip_c·A). Returns (loss, clipfrac), clipfrac 1.0
    where the clipped term is the larger. PPO: https://arxiv.org/abs/1707.06347; DAPO:
    https://arxiv.org/abs/2503.14476; dual clip: https://arxiv.org/abs/1912.09729
    """
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = torch.gt(clipped, unclipped).float()
    if eps_clip_c is not None:
        if not eps_clip_c > 1.0:
            raise ValueError(f"eps_clip_c (dual-clip PPO) must be > 1, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, clipfrac.detach()


def compute_cispo_loss(ppo_kl: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor, *, eps_clip: float,
                       eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): loss = -sg(clip(ratio, 1 - ε, 1 + ε_high))·A·log π.

    ε = eps_clip, ε_high = eps_clip_high. The clipped ratio is a constant, so the gradient flows through log π
    alone, clipped tokens included.
    All inputs [B, T]; returns (loss, clipfrac), clipfrac 1.0 where the clip changed the ratio.
    """
    ratio = torch.exp(-ppo_kl)
    truncated = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return -truncated.detach() * advantages * log_probs, torch.ne(truncated, ratio).float().detach()


def compute_gspo_kl(log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log-ratio (https://arxiv.org/abs/2507.18071): per sample, the masked mean of
    (log π_old - log π) over its tokens, broadcast to every token, so exp(-kl) is the geometric-mean sequence ratio.
    [B, T] -> [B, T]."""
    seq_kl = ((old_log_probs - log_probs) * loss_mask).sum(dim=-1) / loss_mask.sum(dim=-1).clamp_min(1)
    return seq_kl.unsqueeze(-1).expand_as(log_probs)


def tis_weights(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, *, tis_clip: float,
                tis_clip_low: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling between the trainer's and the engines' policies (slime's `vanilla_tis_function`).

    tis = exp(log π_train_old - log π_rollout); weight = clamp(tis, tis_clip_low, tis_clip). [B, T] inputs.
    Returns (weights, per-token metrics {"tis", "tis_clipfrac" (weight != tis), "tis_abs" (|tis - 1|)}), detached.
    https://fengyao.notion.site/off-policy-rl
    """
    tis = torch.exp(train_log_probs - rollout_log_probs).detach()
    weights = tis.clamp(tis_clip_low, tis_clip)
    return weights, {"tis": tis, "tis_clipfrac": torch.ne(weights, tis).float(), "tis_abs": (tis - 1).abs()}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
               value_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (slime's `value_loss_function`): v_clip = v_old + clamp(v - v_old, ±value_clip);
    loss = max((v_clip - R)², (v - R)²), no ½. [B, T] inputs; returns (loss, clipfrac = |v - v_old| > value_clip)."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped - returns).square(), (values - returns).square())
    return loss, torch.gt((values - old_values).abs(), value_clip).float().detach()


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


def policy_loss_function(*, log_probs: torch.Tensor, entropy: torch.Tensor, old_log_probs: torch.Tensor | None,
                         advantages: torch.Tensor, loss_mask: torch.Tensor, reduce: Reducer,
                         advantage_estimator: str = "grpo", eps_clip: float = 0.2, eps_clip_high: float = 0.2,
                         eps_clip_c: float | None = None, entropy_coef: float = 0.0,
                         ref_log_probs: torch.Tensor | None = None, kl_loss_coef: float = 0.0,
                         kl_loss_type: str = "k1", use_unbiased_kl: bool = False,
                         rollout_log_probs: torch.Tensor | None = None, train_log_probs: torch.Tensor | None = None,
                         use_rollout_logprobs: bool = False, use_tis: bool = False, tis_clip: float = 2.0,
                         tis_clip_low: float = 0.0,
                         tis_function: Callable | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's policy objective: loss = pg_loss - entropy_coef·entropy_loss + kl_loss_coef·kl_loss.

    Tensors are [B, T] response-aligned; `reduce` maps a per-token tensor to this micro-batch's share of the step's
    scalar. old_log_probs: the ratio's denominator (recomputed, or the engines' under use_rollout_logprobs); None
    reuses the current log-probs, detached (one step per rollout: ratio 1, ppo_kl 0). The pg term is CISPO's for
    "cispo", GSPO's sequence-level PPO clip for "gspo", the (dual-)clipped PPO surrogate otherwise.
    use_tis multiplies the per-token pg loss by the clipped train/rollout ratio, train_log_probs (the recomputed
    old log-probs; default the detached current ones) over rollout_log_probs; a `tis_function(pg, train_log_probs)
    -> (pg, keep, metrics)` replaces that weighting (slime's custom TIS function: `keep` zeroes the tokens it
    rejects; the reducer's denominators stay the rollout's). ref_log_probs (given under
    use_kl_loss) adds kl_loss, with grad only when kl_loss_coef != 0; entropy's grad flows only when
    entropy_coef != 0. rollout_log_probs also gives train_rollout_logprob_abs_diff. Returns (loss, detached metrics).
    """
    current = log_probs.detach()
    if old_log_probs is None:
        old_log_probs = current
    if advantage_estimator == "gspo":
        ppo_kl = compute_gspo_kl(log_probs, old_log_probs, loss_mask)
    else:
        ppo_kl = old_log_probs - log_probs
    if advantage_estimator == "cispo":
        pg, clipfrac = compute_cispo_loss(ppo_kl, log_probs, advantages, eps_clip=eps_clip, eps_clip_high=eps_clip_high)
    else:
        pg, clipfrac = compute_policy_loss(ppo_kl, advantages, eps_clip=eps_clip, eps_clip_high=eps_clip_high,
                                           eps_clip_c=eps_clip_c)
    metrics: dict[str, torch.Tensor] = {}
    if tis_function is not None:
        pg, keep, tis_metrics = tis_function(pg, current if train_log_probs is None else train_log_probs)
        pg = pg * keep
        metrics.update({key: reduce(value) for key, value in tis_metrics.items()})
        metrics["ois"] = reduce(torch.exp(-ppo_kl.detach()))
    elif use_tis:
        if rollout_log_probs is None:
            raise ValueError("use_tis needs the engines' log-probs (rollout_log_probs) for every sample")
        weights, tis_metrics = tis_weights(current if train_log_probs is None else train_log_probs,
                                           rollout_log_probs, tis_clip=tis_clip, tis_clip_low=tis_clip_low)
        pg = pg * weights
        metrics.update({key: reduce(value) for key, value in tis_metrics.items()})
        metrics["ois"] = reduce(torch.exp(-ppo_kl.detach()))
    pg_loss = reduce(pg)
    entropy_loss = reduce(entropy if entropy_coef != 0.0 else entropy.detach())
    loss = pg_loss - entropy_coef * entropy_loss
    metrics.update({"pg_loss": pg_loss, "pg_clipfrac": reduce(clipfrac), "ppo_kl": reduce(ppo_kl.detach()),
                    "entropy_loss": entropy_loss})
    if ref_log_probs is not None:
        with_grad = kl_loss_coef != 0.0
        kl_log_probs = log_probs if with_grad else current
        ratio = torch.exp(kl_log_probs - old_log_probs.detach()) if use_unbiased_kl else None
        kl_loss = reduce(compute_approx_kl(kl_log_probs, ref_log_probs, kl_loss_type=kl_loss_type,
                                           importance_ratio=ratio))
        if with_grad:
            loss = loss + kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    if rollout_log_probs is not None:
        compared = current if use_rollout_logprobs else old_log_probs
        metrics["train_rollout_logprob_abs_diff"] = reduce((compared - rollout_log_probs).abs())
    metrics["loss"] = loss
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss_function(*, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, reduce: Reducer,
                        value_clip: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's objective: reduce(clipped value loss). Returns (loss, {"value_loss", "value_clipfrac"})."""
    per_token, clipfrac = value_loss(values, old_values, returns, value_clip=value_clip)
    loss = reduce(per_token)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": reduce(clipfrac).detach()}


def sft_loss_function(*, log_probs: torch.Tensor, reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's SFT objective: loss = reduce(-log π(target)) over the response tokens. Returns (loss, {"loss"})."""
    loss = reduce(sft_loss(log_probs))
    return loss, {"loss": loss.detach()}
