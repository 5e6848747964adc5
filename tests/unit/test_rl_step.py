"""The backend-independent RL step: advantages and returns of a rollout, reducers, and micro-batch loss dispatch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from services.common.samples import Sample
from services.trainer.batching.batch import build_rollout_batch
from services.trainer.settings.train import TrainConfig
from services.trainer.step import rl_step
from tests.tiny_samples import two_by_two_batch


def test_grpo_advantages_are_the_group_normalized_rewards():
    batch = rl_step.compute_advantages_and_returns(two_by_two_batch(), TrainConfig(n_samples_per_prompt=2))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # ±0.5 around the group mean, unbiased std sqrt(0.5)
    b = 1.0 / (math.sqrt(2.0) + 1e-6)  # ±1 around 1, std sqrt(2)
    assert batch.advantages.tolist() == [pytest.approx([a, a, 0]), pytest.approx([-a, 0, 0]),
                                         pytest.approx([-b, 0, -b]), pytest.approx([b, b, 0])]
    assert torch.equal(batch.returns, batch.advantages)


def test_kl_reward_shaping_uses_the_old_log_probs_or_the_rollouts():
    batch = two_by_two_batch()
    batch = batch.with_(log_probs=torch.full_like(batch.loss_masks, -1.0), values=torch.zeros_like(batch.loss_masks),
                        ref_log_probs=torch.full_like(batch.loss_masks, -1.25))
    config = TrainConfig(advantage_estimator="ppo", kl_coef=0.4)
    # sample 0: k1 = -1 - (-1.25) = 0.25 per token, r = [-0.1, -0.1 + 1]; γ = λ = 1, V = 0: A = [0.8, 0.9]
    shaped = rl_step.compute_advantages_and_returns(batch, config)
    assert shaped.advantages[0].tolist() == pytest.approx([0.8, 0.9, 0.0])
    # use_rollout_logprobs: k1 = -0.5 - (-1.25) = 0.75, r = [-0.3, 0.7]: A = [0.4, 0.7]
    from_rollout = rl_step.compute_advantages_and_returns(
        batch, TrainConfig(advantage_estimator="ppo", kl_coef=0.4, use_rollout_logprobs=True))
    assert from_rollout.advantages[0].tolist() == pytest.approx([0.4, 0.7, 0.0])
    with pytest.raises(ValueError, match="needs the old and the reference log-probs"):
        rl_step.compute_advantages_and_returns(two_by_two_batch().with_(values=batch.values), config)


def test_normalize_advantages_whitens_over_the_rollouts_unmasked_tokens():
    config = TrainConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, gamma=1.0)
    batch = rl_step.compute_advantages_and_returns(two_by_two_batch(), config)
    mask = batch.loss_masks.bool()
    values = batch.advantages[mask]
    assert values.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert values.std().item() == pytest.approx(1.0, abs=1e-6)  # Bessel-corrected, as the whitening
    assert batch.advantages[~mask].abs().sum().item() == 0.0
    assert batch.returns[0].tolist() == [1.0, 1.0, 0.0]  # returns stay unwhitened


def test_critic_returns_ignore_kl_shaping():
    batch = two_by_two_batch()
    batch = batch.with_(values=torch.zeros_like(batch.loss_masks), log_probs=torch.zeros_like(batch.loss_masks),
                        ref_log_probs=torch.full_like(batch.loss_masks, -1.0))
    config = TrainConfig(advantage_estimator="ppo", kl_coef=0.5)
    assert rl_step.compute_advantages_and_returns(batch, config).returns[0].tolist() == pytest.approx([0.0, 0.5, 0])
    assert rl_step.critic_returns(batch, config)[0].tolist() == [1.0, 1.0, 0.0]


def test_on_policy_distillation_adds_the_reverse_kl_to_any_estimators_advantages():
    """slime's apply_opd_kl_to_advantages: A_t - opd_kl_coef·(log π_student - log π_teacher), the student's log-probs
    being the recomputed old policy's (or the engines' under use_rollout_logprobs); teacher log-probs come with the
    samples (a teacher engine) into the batch."""
    samples = [Sample(tokens=[1, 2, 3, 4], response_length=2, reward=1.0, rollout_log_probs=[-0.5, -0.5],
                      teacher_log_probs=[-2.0, -0.5]),
               Sample(tokens=[1, 2, 5], response_length=1, reward=0.0, rollout_log_probs=[-0.5],
                      teacher_log_probs=[-1.0])]
    batch = build_rollout_batch(samples)
    assert batch.teacher_log_probs.tolist() == [[-2.0, -0.5], [-1.0, 0.0]]
    batch = batch.with_(log_probs=torch.full_like(batch.loss_masks, -1.0))
    config = TrainConfig(n_samples_per_prompt=2, use_opd=True, opd_type="sglang", opd_kl_coef=0.5)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO: rewards 1, 0 around 0.5, std sqrt(0.5)
    # sample 0: reverse KL = -1 - (-2) = 1, -1 - (-0.5) = -0.5; sample 1: -1 - (-1) = 0
    got = rl_step.compute_advantages_and_returns(batch, config)
    assert got.advantages.tolist() == [pytest.approx([a - 0.5, a + 0.25]), pytest.approx([-a, 0.0])]
    assert got.returns.tolist() == [pytest.approx([a, a]), pytest.approx([-a, 0.0])]  # the estimator's own
    # the engines' log-probs as the student's: reverse KL = 1.5, 0 and 0.5
    rollout = rl_step.compute_advantages_and_returns(batch, dataclasses.replace(config, use_rollout_logprobs=True))
    assert rollout.advantages.tolist() == [pytest.approx([a - 0.75, a]), pytest.approx([-a - 0.25, 0.0])]
    # on top of ppo's GAE (V = 0, γ = λ = 1: A_t = reward for every token)
    ppo = dataclasses.replace(config, advantage_estimator="ppo")
    shaped = rl_step.compute_advantages_and_returns(batch.with_(values=torch.zeros_like(batch.loss_masks)), ppo)
    assert shaped.advantages.tolist() == [pytest.approx([0.5, 1.25]), pytest.approx([0.0, 0.0])]
    assert rl_step.needs_old_log_probs(config, 1)  # slime recomputes them under OPD
    with pytest.raises(ValueError, match="teacher model's forward"):
        rl_step.compute_advantages_and_returns(two_by_two_batch().with_(log_probs=torch.zeros(4, 3)),
                                               dataclasses.replace(config, opd_type="megatron"))


def test_distillation_metric_is_the_reverse_kl_reduced_as_the_loss():
    samples = [Sample(tokens=[1, 2, 3, 4], response_length=2, reward=1.0, teacher_log_probs=[-2.0, -0.5])]
    batch = build_rollout_batch(samples).with_(log_probs=torch.full((1, 2), -1.0))
    batch = batch.with_(advantages=torch.zeros(1, 2))
    config = TrainConfig(use_opd=True, opd_type="sglang")
    reduce = rl_step.make_reducer(config, batch.loss_masks, batch.loss_masks.sum(-1), 1.0)
    _, metrics = rl_step.policy_loss(config, batch, log_probs=torch.full((1, 2), -1.0),
                                     entropy=torch.zeros(1, 2), reduce=reduce)
    assert metrics["opd_reverse_kl"].item() == pytest.approx((1.0 - 0.5) / 2)


@pytest.mark.parametrize("overrides, num_steps, expected", [
    ({}, 1, False), ({}, 2, True), ({"advantage_estimator": "gspo"}, 1, True),
    ({"advantage_estimator": "ppo"}, 1, True), ({"use_rollout_logprobs": True}, 2, False),
    ({"advantage_estimator": "ppo", "kl_coef": 0.1}, 1, True), ({"loss_type": "sft_loss"}, 2, False),
    ({"loss_type": "custom_loss", "custom_loss_function_path": "tests.plugins.loss_fns.mean_nll"}, 1, True),
])
def test_old_log_probs_are_recomputed_unless_slime_can_reuse_them(overrides, num_steps, expected):
    assert rl_step.needs_old_log_probs(TrainConfig(**overrides), num_steps) is expected


def test_reducers_and_normalizers():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    sample_mean = TrainConfig()
    normalizer = rl_step.step_normalizer(sample_mean, torch.tensor([2.0, 1.0, 0.0]))
    assert normalizer == 3.0  # three samples in the step
    reduce = rl_step.make_reducer(sample_mean, mask, mask.sum(-1), normalizer)
    assert reduce(x).item() == pytest.approx((1.5 + 4.0) / 3)
    per_token = TrainConfig(calculate_per_token_loss=True)
    normalizer = rl_step.step_normalizer(per_token, torch.tensor([2.0, 1.0, 0.0]))
    assert normalizer == 4.0  # 2 + 1 tokens, and an empty sample counts 1
    assert rl_step.make_reducer(per_token, mask, mask.sum(-1), normalizer)(x).item() == pytest.approx(7 / 4)


def test_custom_loss_gets_slimes_packed_logits_batch_and_reducer():
    batch = two_by_two_batch().take([0, 2])
    batch = batch.with_(log_probs=torch.zeros_like(batch.loss_masks))
    logits = torch.randn(2, 4, 10, requires_grad=True)
    seen = {}

    def fn(args, data, packed, sum_of_sample_mean):
        seen.update(args=args, data=data, packed=packed)
        flat = torch.ones(sum(data["response_lengths"]))  # slime's packed response tokens
        return packed.sum() * 0 + sum_of_sample_mean(flat), {"ones": sum_of_sample_mean(flat)}

    config = TrainConfig(loss_type="custom_loss", custom_loss_function_path="tests.plugins.loss_fns.mean_nll")
    loss, metrics = rl_step.micro_batch_loss(config, batch, logits=logits,
                                             reduce=lambda x: (x * batch.loss_masks).sum(), custom_loss_fn=fn)
    assert seen["packed"].shape == (1, 4 + 4, 10)  # both samples are 4 tokens long
    assert torch.equal(seen["packed"][0, 4:], logits[1])
    assert seen["data"]["response_lengths"] == [2, 3] and seen["data"]["total_lengths"] == [4, 4]
    assert [m.tolist() for m in seen["data"]["loss_masks"]] == [[1, 1], [1, 0, 1]]
    assert "log_probs" in seen["data"] and "values" not in seen["data"]
    assert seen["args"].loss_type == "custom_loss"
    assert loss.item() == 4.0 and metrics["ones"].item() == 4.0 and metrics["loss"].item() == 4.0  # masked one out
