"""Reverse scans over response tokens: γ-discounted returns (REINFORCE++) and GAE (PPO).

Rows are right-padded [B, T]; padding must carry zero rewards and zero values, so it adds nothing to the
real tokens before it (slime pads the same way before its chunked scan; a plain loop over T gives the same numbers).
"""

from __future__ import annotations

import torch


def discounted_returns(rewards: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ·G_{t+1}, G_T = 0. rewards: [B, T] -> returns [B, T]. REINFORCE++: https://arxiv.org/abs/2501.03262"""
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns


def gae(rewards: torch.Tensor, values: torch.Tensor, *, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (slime's `get_advantages_and_returns_batch`); rewards, values: [B, T].

    δ_t = r_t + γ·V_{t+1} - V_t with V_T = 0; A_t = Σ_l (γλ)^l δ_{t+l}; returns = A + V.
    Returns (advantages, returns), both [B, T], without grad. GAE: https://arxiv.org/abs/1506.02438
    """
    with torch.no_grad():
        next_values = torch.cat([values[:, 1:], values.new_zeros(values.shape[0], 1)], dim=1)
        deltas = rewards + gamma * next_values - values
        advantages = torch.zeros_like(deltas)
        running = deltas.new_zeros(deltas.shape[0])
        for t in reversed(range(deltas.shape[1])):
            running = deltas[:, t] + gamma * lambd * running
            advantages[:, t] = running
        return advantages, advantages + values
