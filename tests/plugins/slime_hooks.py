"""Trainer-side hooks with slime's signatures, small enough to check by hand: a reward post-process, an advantage
function and a TIS function shaped like slime's MIS helper (token level, mask mode, bounds from custom_config_path),
which imports slime's cp_utils as that helper does."""

from __future__ import annotations

from typing import Any

import torch


def center_rewards(args, samples):
    """Rewards minus the batch mean (one baseline for all groups); raw rewards by reward_key as slime reads them."""
    raw = [float(sample.get_reward_value(args)) for sample in samples]
    mean = sum(raw) / len(raw)
    return raw, [r - mean for r in raw]


def position_weighted(args, rollout_data):
    """A_t = reward · (t + 1) on each sample's response tokens; returns = advantages."""
    advantages = [reward * torch.arange(1, n + 1, dtype=torch.float32)
                  for reward, n in zip(rollout_data["rewards"], rollout_data["response_lengths"], strict=True)]
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = advantages


def mis_token_mask(args, *, pg_loss: torch.Tensor, train_log_probs: list[torch.Tensor],
                   rollout_log_probs: list[torch.Tensor], loss_masks: list[torch.Tensor], total_lengths: list[int],
                   response_lengths: list[int], **kwargs: Any):
    """w = exp(train - rollout) per token; tokens with w outside [tis_lower_bound, tis_upper_bound] are rejected
    (mask 0), the rest weigh the loss by w. Metric mis_reject_fraction: 1 on rejected tokens."""
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    weights, masks, rejected = [], [], []
    for train, rollout, mask, total, n in zip(train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                               response_lengths, strict=True):
        w = torch.exp(all_gather_with_cp(train, total, n) - all_gather_with_cp(rollout, total, n))
        keep = ((w >= args.tis_lower_bound) & (w <= args.tis_upper_bound)).float()
        weights.append(slice_log_prob_with_cp(w * keep, total, n))
        masks.append(mask * keep)
        rejected.append(1.0 - keep)
    return pg_loss * torch.cat(weights), masks, {"mis_reject_fraction": torch.cat(rejected)}
