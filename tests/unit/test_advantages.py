"""Reward post-processing, every advantage estimator and advantage whitening against hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.algorithms.advantages import (
    ESTIMATORS,
    get_advantage_estimator,
    grpo_advantages,
    normalize_advantages,
    normalize_group_rewards,
    post_process_rewards,
    ppo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
)
from services.trainer.settings.train import ADVANTAGE_ESTIMATORS

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
    advantages, returns = grpo_advantages(torch.tensor([2.0, -1.0]), loss_mask=mask)
    assert advantages.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, -1.0]]
    assert returns is advantages


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_gspo_and_cispo_share_grpos_advantages_and_ignore_kl(name):
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    advantages, _ = ESTIMATORS[name](torch.tensor([0.5]), kl=torch.ones(1, 3), loss_mask=mask,
                                     response_lengths=torch.tensor([2]), values=None, kl_coef=0.3, gamma=1.0,
                                     lambd=1.0)
    assert advantages.tolist() == [[0.5, 0.5, 0.0]]


def test_ppo_gae_with_gamma_and_lambda_below_one():
    # row 0: 3 tokens, reward 1 on the last; row 1: 2 tokens (+1 padding), reward 2 on its last
    values = torch.tensor([[0.5, 0.4, 0.3], [1.0, 0.5, 9.0]])  # the 9.0 on padding must be ignored
    advantages, returns = ppo_advantages(torch.tensor([1.0, 2.0]), kl=torch.zeros(2, 3),
                                         response_lengths=torch.tensor([3, 2]), values=values, kl_coef=0.0,
                                         gamma=0.9, lambd=0.8)
    # row 0: δ = [0.9·0.4 - 0.5, 0.9·0.3 - 0.4, 1 - 0.3] = [-0.14, -0.13, 0.7]; γλ = 0.72
    #        A2 = 0.7, A1 = -0.13 + 0.72·0.7 = 0.374, A0 = -0.14 + 0.72·0.374 = 0.12928
    # row 1: δ = [0.9·0.5 - 1.0, 2 - 0.5] = [-0.55, 1.5]; A1 = 1.5, A0 = -0.55 + 0.72·1.5 = 0.53
    assert advantages.tolist() == [pytest.approx([0.12928, 0.374, 0.7]), pytest.approx([0.53, 1.5, 0.0])]
    assert returns.tolist() == [pytest.approx([0.62928, 0.774, 1.0]), pytest.approx([1.53, 2.0, 0.0])]


def test_ppo_kl_coef_shapes_every_token_reward():
    # γ = λ = 1, V = 0: A_t = Σ_{t' >= t} r_t', r = -0.1·kl + reward on the last token
    advantages, returns = ppo_advantages(torch.tensor([1.0]), kl=torch.tensor([[0.5, 1.0, 2.0]]),
                                         response_lengths=torch.tensor([3]), values=torch.zeros(1, 3), kl_coef=0.1,
                                         gamma=1.0, lambd=1.0)
    assert advantages[0].tolist() == pytest.approx([0.65, 0.7, 0.8])  # r = [-0.05, -0.1, 0.8]
    assert returns[0].tolist() == pytest.approx([0.65, 0.7, 0.8])


def test_ppo_needs_values():
    with pytest.raises(ValueError, match="needs critic values"):
        ppo_advantages(torch.ones(1), kl=torch.zeros(1, 1), response_lengths=torch.tensor([1]), values=None,
                       kl_coef=0.0, gamma=1.0, lambd=1.0)


def test_reinforce_plus_plus_discounted_returns_with_variable_lengths():
    loss_mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # row 1 is 2 tokens long; row 2 is 3 long with its last token masked: the reward goes on token 1
    advantages, returns = reinforce_plus_plus_advantages(torch.tensor([1.0, 2.0, -1.0]), kl=torch.zeros(3, 3),
                                                         loss_mask=loss_mask, kl_coef=0.0, gamma=0.5)
    assert advantages.tolist() == [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0], [-0.5, -1.0, 0.0]]
    assert returns is advantages


def test_reinforce_plus_plus_kl_coef_shapes_unmasked_tokens():
    advantages, _ = reinforce_plus_plus_advantages(torch.tensor([1.0]), kl=torch.ones(1, 3),
                                                   loss_mask=torch.ones(1, 3), kl_coef=0.1, gamma=0.5)
    # r = [-0.1, -0.1, 0.9]: G2 = 0.9, G1 = -0.1 + 0.45 = 0.35, G0 = -0.1 + 0.175 = 0.075
    assert advantages[0].tolist() == pytest.approx([0.075, 0.35, 0.9])


def test_reinforce_plus_plus_baseline_subtracts_kl_from_the_group_centred_reward():
    rewards = post_process_rewards(torch.tensor([1.0, 0.0]), advantage_estimator="reinforce_plus_plus_baseline",
                                   n_samples_per_prompt=2)
    advantages, returns = reinforce_plus_plus_baseline_advantages(
        rewards, kl=torch.tensor([[0.2, 0.4], [0.0, 0.0]]), loss_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        kl_coef=0.5)
    assert advantages.tolist() == [pytest.approx([0.4, 0.3]), [-0.5, 0.0]]
    assert returns is advantages


def test_normalize_advantages_masked_with_bessel_correction():
    advantages = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = normalize_advantages(advantages, mask)
    # unmasked 1..4: mean 2.5, population var 1.25, Bessel ×4/3 -> 5/3
    std = math.sqrt(5 / 3 + 1e-8)
    assert out.tolist() == [pytest.approx([-1.5 / std, -0.5 / std, 0.0]), pytest.approx([0.5 / std, 1.5 / std, 0.0])]


def test_normalize_advantages_eps_is_1e_minus_8():
    out = normalize_advantages(torch.tensor([[0.0, 1e-4]]), torch.ones(1, 2))
    # mean 5e-5, Bessel var 2·2.5e-9 = 5e-9; ±5e-5 / sqrt(5e-9 + 1e-8) = ±0.40825 (±0.7071 without eps)
    assert out[0].tolist() == pytest.approx([-0.408248, 0.408248], rel=1e-4)


def test_normalize_advantages_all_reduces_sum_sum_sq_and_count_over_the_group(monkeypatch):
    import services.trainer.algorithms.advantages as module

    other_rank = torch.tensor([[3.0, 4.0]])  # what a second data-parallel rank holds

    def all_reduce(stats, group):
        assert group == "dp-group"
        stats += torch.stack([other_rank.sum(), other_rank.square().sum(), torch.tensor(2.0)])

    monkeypatch.setattr(module.dist, "all_reduce", all_reduce)
    out = normalize_advantages(torch.tensor([[1.0, 2.0]]), torch.ones(1, 2), group="dp-group")
    std = math.sqrt(5 / 3 + 1e-8)  # statistics of 1, 2, 3, 4 as above
    assert out[0].tolist() == pytest.approx([-1.5 / std, -0.5 / std])


def test_normalize_advantages_without_tokens_fails():
    with pytest.raises(ValueError, match="no unmasked tokens"):
        normalize_advantages(torch.ones(1, 2), torch.zeros(1, 2))


def test_estimators_are_picked_by_slime_name():
    assert ESTIMATORS["grpo"] is grpo_advantages
    assert get_advantage_estimator("ppo") is ppo_advantages
    assert set(ESTIMATORS) == set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match=r"unknown advantage_estimator 'grpoo'; valid: cispo, grpo, gspo, ppo, "):
        get_advantage_estimator("grpoo")


def test_a_fanned_out_prompt_is_normalized_over_its_own_trajectories():
    """Prompt 7 fanned out into 3 trajectories, prompt 9 into 1 (n = 2): each group's baseline is its own rows',
    by hand: group 7 = [1, 0, 0] -> mean 1/3, unbiased std sqrt(1/3); group 9 = [0.5] -> centred only."""
    from services.common.samples import Sample
    from services.trainer.algorithms.advantages import normalize_rewards_by_group, post_process_rewards
    from services.trainer.step.rl_step import fanned_out_groups

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5])
    samples = [Sample(group_index=g) for g in (7, 7, 7, 9)]
    ids = fanned_out_groups(samples, 2)
    assert ids == [0, 0, 0, 1]
    std = (1 / 3) ** 0.5
    expected = torch.tensor([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0.0])
    got = post_process_rewards(rewards, advantage_estimator="grpo", n_samples_per_prompt=2, group_ids=ids)
    assert torch.allclose(got, expected, atol=1e-5)
    # rows cut every n would have paired trajectories of different prompts: [1, 0] and [0, 0.5]
    assert not torch.allclose(got, normalize_group_rewards(rewards, n_samples_per_prompt=2), atol=1e-3)
    centred = normalize_rewards_by_group(rewards, ids, std_normalization=False)
    assert torch.allclose(centred, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0]), atol=1e-6)
    assert fanned_out_groups([Sample(group_index=g) for g in (1, 1, 2, 2)], 2) is None  # slime's reshape is the same
    # one prompt in two epochs of a rollout: two groups of n, not one of 2n
    assert fanned_out_groups([Sample(group_index=g, index=i % 2) for i, g in enumerate((3, 3, 4, 4, 3, 3))], 2) is None
    # samples built by hand, with no grouping: cut every n
    assert fanned_out_groups([Sample(reward=r) for r in (1.0, 0.0, 0.0, 1.0)], 2) is None
    with pytest.raises(ValueError, match="3 group ids for 4 rewards"):
        normalize_rewards_by_group(rewards, [1, 1, 2])
