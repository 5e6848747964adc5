"""Discounted returns and GAE scans against hand-derived numbers and a naive double sum."""

from __future__ import annotations

import pytest
import torch

from services.trainer.algorithms.returns import discounted_returns, gae


def test_discounted_returns():
    returns = discounted_returns(torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 0.0]]), gamma=0.5)
    assert returns.tolist() == [[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]]


def test_gae_equals_the_lambda_weighted_sum_of_deltas():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 6), torch.randn(3, 6)
    gamma, lambd = 0.95, 0.7
    advantages, returns = gae(rewards, values, gamma=gamma, lambd=lambd)
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1)], dim=1)
    deltas = rewards + gamma * next_values - values
    expected = torch.stack([sum((gamma * lambd) ** (u - t) * deltas[:, u] for u in range(t, 6)) for t in range(6)], 1)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected + values)


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    advantages, returns = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.2, 0.4, 0.6]]), gamma=1.0, lambd=1.0)
    assert advantages[0].tolist() == pytest.approx([0.8, 0.6, 0.4])
    assert returns[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
