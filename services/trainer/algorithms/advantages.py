"""Reward post-processing (group baselines) and advantage estimators, as in slime's rollout/loss code.

Estimators are picked from `ESTIMATORS` by slime's `--advantage-estimator` names; each is a pure function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# slime's `_post_process_rewards`: these estimators subtract the group mean (unless
# --disable-rewards-normalization); the std ones also divide by the group std (unless
# --disable-grpo-std-normalization, i.e. Dr.GRPO). Other estimators get raw rewards.
GROUP_MEAN_ESTIMATORS = frozenset({"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"})
GROUP_STD_ESTIMATORS = frozenset({"grpo", "gspo", "cispo"})


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


def post_process_rewards(rewards: torch.Tensor, *, advantage_estimator: str, n_samples_per_prompt: int,
                         rewards_normalization: bool = True, grpo_std_normalization: bool = True) -> torch.Tensor:
    """slime's reward post-processing: the group baseline the estimator calls for, or raw rewards. [N] -> [N]."""
    if advantage_estimator not in GROUP_MEAN_ESTIMATORS or not rewards_normalization:
        return rewards.float()
    return normalize_group_rewards(
        rewards, n_samples_per_prompt=n_samples_per_prompt,
        std_normalization=grpo_std_normalization and advantage_estimator in GROUP_STD_ESTIMATORS)


def grpo_advantages(rewards: torch.Tensor, *, loss_mask: torch.Tensor) -> torch.Tensor:
    """GRPO: the (already normalized) scalar reward of each sample broadcast to its response tokens.

    rewards: [B]; loss_mask: [B, R] (0 on padding and masked tokens). Returns A[i, t] = rewards[i] * loss_mask[i, t].
    No KL reward shaping (slime applies none for grpo/gspo/cispo); advantages double as returns.
    """
    return rewards.to(loss_mask.dtype).unsqueeze(-1) * loss_mask


# Later estimators (gspo, cispo, ppo, reinforce_plus_plus, ...) add keyword arguments they need (kl, values).
ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {"grpo": grpo_advantages}


def get_advantage_estimator(name: str) -> Callable[..., torch.Tensor]:
    """The estimator for slime's `--advantage-estimator` name; unknown names fail listing the valid ones."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage_estimator {name!r}; valid: {', '.join(sorted(ESTIMATORS))}") from None
