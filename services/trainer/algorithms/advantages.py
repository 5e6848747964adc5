"""Reward post-processing (group baselines), advantage estimators and advantage whitening, as in slime.

Estimators are picked from `ESTIMATORS` by slime's `--advantage-estimator` names. Each is a pure function
`(rewards, *, kl, loss_mask, response_lengths, values, kl_coef, gamma, lambd) -> (advantages, returns)` that reads the
keyword arguments it needs and ignores the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from services.trainer.algorithms.returns import discounted_returns, gae

# slime's `_post_process_rewards`: these estimators subtract the group mean (unless
# --disable-rewards-normalization); the std ones also divide by the group std (unless
# --disable-grpo-std-normalization, i.e. Dr.GRPO). Other estimators get raw rewards.
GROUP_MEAN_ESTIMATORS = frozenset({"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"})
GROUP_STD_ESTIMATORS = frozenset({"grpo", "gspo", "cispo"})
# Estimators whose advantages slime only accepts whitened (--normalize-advantages).
NEEDS_NORMALIZED_ADVANTAGES = frozenset({"reinforce_plus_plus", "reinforce_plus_plus_baseline"})


def normalize_group_rewards(rewards: torch.Tensor, *, n_samples_per_prompt: int, std_normalization: bool = True,
                            eps: float = 1e-6) -> torch.Tensor:
    """GRPO group baseline: `r' = r - mean_g(r)`, then `r' / (std_g(r) + eps)` with std_normalization.

    rewards: [N] scalar rewards, the samples of one prompt consecutive. Groups are rows of `rewards.reshape(-1, n)`
    when N is a multiple of n = n_samples_per_prompt, otherwise the whole batch is one group (slime's fallback).
    std is torch's unbiased std; std normalization is forced off when n == 1 (or a group has one sample).
    Returns [N] float32. GRPO: https://arxiv.org/abs/2402.03300; Dr.GRPO (no std): https://arxiv.org/abs/2503.20783
    """
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    rewards = rewards.float()
    num = rewards.numel()
    if num == 0:
        return rewards.reshape(0)
    groups = rewards.reshape(-1, n_samples_per_prompt) if num % n_samples_per_prompt == 0 else rewards.reshape(1, -1)
    groups = groups - groups.mean(dim=-1, keepdim=True)
    if std_normalization and n_samples_per_prompt > 1 and groups.shape[-1] > 1:
        groups = groups / (groups.std(dim=-1, keepdim=True) + eps)
    return groups.reshape(-1)


def normalize_rewards_by_group(rewards: torch.Tensor, group_ids: Sequence[int], *, std_normalization: bool = True,
                               eps: float = 1e-6) -> torch.Tensor:
    """The GRPO group baseline of normalize_group_rewards over groups of any size: the rows sharing a group id
    (a prompt whose agent fanned out into several trajectories). A group of one is only centred. [N] -> [N]."""
    if len(group_ids) != rewards.numel():
        raise ValueError(f"{len(group_ids)} group ids for {rewards.numel()} rewards")
    rewards = rewards.float()
    out = torch.empty_like(rewards)
    ids = torch.tensor(list(group_ids), device=rewards.device)
    for group in torch.unique(ids):
        rows = ids == group
        centred = rewards[rows] - rewards[rows].mean()
        if std_normalization and int(rows.sum()) > 1:
            centred = centred / (rewards[rows].std() + eps)
        out[rows] = centred
    return out


def post_process_rewards(rewards: torch.Tensor, *, advantage_estimator: str, n_samples_per_prompt: int,
                         rewards_normalization: bool = True, grpo_std_normalization: bool = True,
                         group_ids: Sequence[int] | None = None) -> torch.Tensor:
    """slime's reward post-processing: the group baseline the estimator calls for, or raw rewards. [N] -> [N].
    With `group_ids` (each row's prompt), groups are those rows, whatever their sizes."""
    if advantage_estimator not in GROUP_MEAN_ESTIMATORS or not rewards_normalization:
        return rewards.float()
    std = grpo_std_normalization and advantage_estimator in GROUP_STD_ESTIMATORS
    if group_ids is not None:
        return normalize_rewards_by_group(rewards, group_ids, std_normalization=std and n_samples_per_prompt > 1)
    return normalize_group_rewards(rewards, n_samples_per_prompt=n_samples_per_prompt, std_normalization=std)


def response_mask(response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float32: 1 on the first response_lengths[i] columns of row i (the real response tokens)."""
    return (torch.arange(width, device=response_lengths.device) < response_lengths.unsqueeze(-1)).float()


def grpo_advantages(rewards: torch.Tensor, *, loss_mask: torch.Tensor, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO / GSPO / CISPO: the (already normalized) scalar reward of each sample broadcast to its response tokens.

    rewards: [B]; loss_mask: [B, R] (0 on padding and masked tokens). A[i, t] = rewards[i]·loss_mask[i, t]; no KL
    reward shaping (slime applies none to this family); returns = advantages.
    """
    advantages = rewards.to(loss_mask.dtype).unsqueeze(-1) * loss_mask
    return advantages, advantages


def ppo_advantages(rewards: torch.Tensor, *, kl: torch.Tensor, response_lengths: torch.Tensor,
                   values: torch.Tensor | None, kl_coef: float, gamma: float, lambd: float,
                   **_) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: token rewards r_t = -kl_coef·kl_t, plus the scalar reward on the last response token; then GAE.

    rewards: [B]; kl, values: [B, R] (values from the critic). Returns (advantages, returns) [B, R], zero on padding.
    PPO: https://arxiv.org/abs/1707.06347
    """
    if values is None:
        raise ValueError("advantage_estimator 'ppo' needs critic values")
    valid = response_mask(response_lengths, kl.shape[1])
    token_rewards = -kl_coef * kl.float() * valid
    # the reward on each sample's last response token (none for an empty response), without a host sync
    positions = torch.arange(kl.shape[1], device=kl.device)
    last = positions == (response_lengths.to(kl.device) - 1).unsqueeze(-1)
    token_rewards = token_rewards + rewards.float().unsqueeze(-1) * last
    advantages, returns = gae(token_rewards, values.float() * valid, gamma=gamma, lambd=lambd)
    return advantages * valid, returns * valid


def reinforce_plus_plus_advantages(rewards: torch.Tensor, *, kl: torch.Tensor, loss_mask: torch.Tensor,
                                   kl_coef: float, gamma: float, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: r_t = -kl_coef·kl_t·m_t, plus the scalar reward on the last unmasked token; advantages = the
    γ-discounted returns G_t = r_t + γ·G_{t+1}. A sample with no unmasked token gets zeros.
    https://arxiv.org/abs/2501.03262
    """
    token_rewards = -kl_coef * kl.float() * loss_mask
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    last = torch.where(loss_mask > 0, positions, -1).max(dim=-1).values
    token_rewards = token_rewards + rewards.float().unsqueeze(-1) * (positions == last.unsqueeze(-1))  # -1: none
    returns = discounted_returns(token_rewards, gamma=gamma) * loss_mask
    return returns, returns


def reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, *, kl: torch.Tensor, loss_mask: torch.Tensor,
                                            kl_coef: float, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: the group-mean-subtracted reward broadcast per token, minus kl_coef·kl_t (unwhitened)."""
    advantages = (rewards.float().unsqueeze(-1) - kl_coef * kl.float()) * loss_mask
    return advantages, advantages


Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo_advantages,
    "gspo": grpo_advantages,  # same advantages; the sequence-level ratio is in the loss
    "cispo": grpo_advantages,  # same advantages; the stop-gradient clipped weight is in the loss
    "ppo": ppo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
}


def get_advantage_estimator(name: str) -> Estimator:
    """The estimator for slime's `--advantage-estimator` name; unknown names fail listing the valid ones."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage_estimator {name!r}; valid: {', '.join(sorted(ESTIMATORS))}") from None


def opd_advantages(advantages: torch.Tensor, *, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                   loss_mask: torch.Tensor, opd_kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (slime's `apply_opd_kl_to_advantages`, after tinker-cookbook's): every token's
    advantage gets the reverse-KL penalty of the student's own sampled token,
    A_t - opd_kl_coef · (log π_student(y_t) - log π_teacher(y_t)), on top of any estimator (and before whitening).

    All [B, R]; masked tokens stay 0. Returns (advantages, reverse_kl). Distillation as RL:
    https://thinkingmachines.ai/blog/on-policy-distillation/
    """
    reverse_kl = (student_log_probs.float() - teacher_log_probs.float()) * loss_mask
    return advantages.float() - opd_kl_coef * reverse_kl, reverse_kl


def normalize_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor, *,
                         group: dist.ProcessGroup | None = None, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening (slime's `distributed_masked_whiten`): (A - mean) / sqrt(var + eps) over unmasked tokens.

    advantages, loss_mask: [B, R]. mean and var come from (Σ m·A, Σ m·A², Σ m), all-reduced (sum) over `group`
    when given (data-parallel ranks), so every rank whitens with the same statistics; var carries Bessel's
    correction n / (n - 1) when n >= 2. Masked tokens are set to 0. Returns [B, R] float32.
    """
    advantages, loss_mask = advantages.float(), loss_mask.float()
    stats = torch.stack([(advantages * loss_mask).sum(), (advantages.square() * loss_mask).sum(), loss_mask.sum()])
    if group is not None:
        dist.all_reduce(stats, group=group)
    total, total_sq, count = stats.unbind()
    if not stats.is_meta and count.item() == 0:  # the one host sync (meta tensors: shape-only checks)
        raise ValueError("normalize_advantages: no unmasked tokens to compute the mean and std from")
    mean = total / count
    var = total_sq / count - mean * mean
    var = torch.where(count >= 2, var * count / (count - 1).clamp_min(1), var)
    return (advantages - mean) / (var.clamp_min(0.0) + eps).sqrt() * loss_mask
