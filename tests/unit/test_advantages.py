"""Reward post-processing and advantage estimators against hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.algorithms.advantages import (
    ESTIMATORS,
    get_advantage_estimator,
    grpo_advantages,
    normalize_group_rewards,
    post_process_rewards,
)

EPS = 1e-6


def test_group_mean_and_unbiased_std_per_group_of_n():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    out = normalize_group_rewards(rewards, n_samples_per_prompt=4)
    # group 1: mean 0.25, centred [.75, -.25, -.25, -.25], unbiased var (.5625 + 3 * .0625) / 3 = .25, std .5
    # group 2: mean 0.5, centred ±.5, unbiased var 1 / 3
    s2 = math.sqrt(1 / 3)
    expected = [0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS),
                0.5 / (s2 + EPS), 0.5 / (s2 + EPS), -0.5 / (s2 + EPS), -0.5 / (s2 + EPS)]
    assert out.tolist() == pytest.approx(expected, abs=1e-6)
    assert out.dtype == torch.float32


def test_without_std_only_the_group_mean_is_subtracted():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    out = normalize_group_rewards(rewards, n_samples_per_prompt=4, std_normalization=False)
    assert out.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])


def test_n_equal_one_forces_std_off_and_centres_each_sample_on_itself():
    out = normalize_group_rewards(torch.tensor([3.0, -1.0]), n_samples_per_prompt=1)
    assert out.tolist() == [0.0, 0.0]  # slime: groups of one, mean subtracted, no std (no NaN)


def test_count_not_a_multiple_of_n_makes_the_whole_batch_one_group():
    out = normalize_group_rewards(torch.tensor([1.0, 2.0, 3.0]), n_samples_per_prompt=2)
    assert out.tolist() == pytest.approx([-1 / (1 + EPS), 0.0, 1 / (1 + EPS)])  # mean 2, unbiased std 1


def test_identical_rewards_give_zero_not_nan():
    out = normalize_group_rewards(torch.tensor([1.0, 1.0, 0.0, 0.0]), n_samples_per_prompt=2)
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_post_process_follows_the_estimator_and_the_switches():
    rewards = torch.tensor([1.0, 0.0])
    assert post_process_rewards(rewards, advantage_estimator="grpo", n_samples_per_prompt=2).tolist() == \
        pytest.approx([0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)])
    assert post_process_rewards(rewards, advantage_estimator="grpo", n_samples_per_prompt=2,
                                grpo_std_normalization=False).tolist() == [0.5, -0.5]
    assert post_process_rewards(rewards, advantage_estimator="grpo", n_samples_per_prompt=2,
                                rewards_normalization=False).tolist() == [1.0, 0.0]
    # slime: reinforce_plus_plus_baseline subtracts the mean but never divides by std; ppo gets raw rewards
    assert post_process_rewards(rewards, advantage_estimator="reinforce_plus_plus_baseline",
                                n_samples_per_prompt=2).tolist() == [0.5, -0.5]
    assert post_process_rewards(rewards, advantage_estimator="ppo", n_samples_per_prompt=2).tolist() == [1.0, 0.0]


def test_grpo_broadcasts_the_scalar_to_masked_response_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    adv = grpo_advantages(torch.tensor([2.0, -1.0]), loss_mask=mask)
    assert adv.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, -1.0]]


def test_estimators_are_picked_by_slime_name():
    assert ESTIMATORS["grpo"] is grpo_advantages
    assert get_advantage_estimator("grpo") is grpo_advantages
    with pytest.raises(ValueError, match=r"unknown advantage_estimator 'grpoo'; valid: grpo"):
        get_advantage_estimator("grpoo")
