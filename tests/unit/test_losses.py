"""Log-probs/entropy, PPO-clip policy loss, SFT loss and the reducers against hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.algorithms.losses import (
    policy_loss,
    policy_loss_function,
    sft_loss,
    sft_loss_function,
    sum_of_sample_mean,
    sum_of_token,
    token_log_probs_and_entropy,
)


def test_log_probs_and_entropy_of_a_two_token_vocab():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # softmax [1/4, 3/4]
    log_probs, entropy = token_log_probs_and_entropy(logits, torch.tensor([[1]]))
    assert log_probs.shape == entropy.shape == (1, 1)
    assert log_probs.item() == pytest.approx(math.log(0.75))
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def test_temperature_divides_the_logits():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    log_probs, entropy = token_log_probs_and_entropy(logits, torch.tensor([[1]]), temperature=2.0)
    p = math.sqrt(3) / (1 + math.sqrt(3))  # softmax([0, ln 3 / 2])
    assert log_probs.item() == pytest.approx(math.log(p))
    assert entropy.item() == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)))


# ratios and advantages: a = (1.5, +1) clipped, b = (0.5, +1) not, c = (0.5, -1) clipped, d = (1.5, -1) not,
# e = (1.25, +1) clipped at eps_high 0.2 but not at 0.28.
RATIOS = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.25]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5, -1.0, -3.0]])


def test_symmetric_clip():
    log_probs = (OLD + RATIOS.log()).requires_grad_()
    loss, metrics = policy_loss(log_probs, OLD, ADVANTAGES, eps_clip=0.2, eps_clip_high=0.2)
    assert loss[0].tolist() == pytest.approx([-1.2, -0.5, 0.8, 1.5, -1.2])
    assert metrics["clipfrac"][0].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert metrics["ppo_kl"][0].tolist() == pytest.approx((-RATIOS.log())[0].tolist())  # old - new
    loss.sum().backward()
    # unclipped tokens: d(-ratio·A)/d log π = -ratio·A; clipped tokens carry no gradient
    assert log_probs.grad[0].tolist() == pytest.approx([0.0, -0.5, 0.0, 1.5, 0.0])


def test_clip_higher_widens_only_the_upper_bound():
    log_probs = OLD + RATIOS.log()
    loss, metrics = policy_loss(log_probs, OLD, ADVANTAGES, eps_clip=0.2, eps_clip_high=0.28)
    assert loss[0].tolist() == pytest.approx([-1.28, -0.5, 0.8, 1.5, -1.25])
    assert metrics["clipfrac"][0].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_on_policy_loss_is_minus_advantage():
    loss, metrics = policy_loss(OLD, OLD, ADVANTAGES, eps_clip=0.2, eps_clip_high=0.2)
    assert loss.tolist() == (-ADVANTAGES).tolist()
    assert metrics["clipfrac"].sum().item() == 0.0 and metrics["ppo_kl"].abs().sum().item() == 0.0


def test_sft_loss_is_negative_log_prob():
    assert sft_loss(torch.tensor([[-0.5, -2.0]])).tolist() == [[0.5, 2.0]]


X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_sum_of_sample_mean():
    assert sum_of_sample_mean(X, MASK, denominators=torch.tensor([2.0, 1.0])).item() == pytest.approx(3 / 2 + 4 / 1)
    # rollout denominators may exceed the sample's own mask; a zero denominator counts as 1
    assert sum_of_sample_mean(X, MASK, denominators=torch.tensor([4, 0])).item() == pytest.approx(3 / 4 + 4)


def test_sum_of_sample_mean_splits_over_micro_batches():
    den = MASK.sum(-1)
    whole = sum_of_sample_mean(X, MASK, denominators=den)
    parts = sum_of_sample_mean(X[:1], MASK[:1], denominators=den[:1]) + \
        sum_of_sample_mean(X[1:], MASK[1:], denominators=den[1:])
    assert parts.item() == whole.item()


def test_sum_of_token():
    assert sum_of_token(X, MASK).item() == 7.0


def test_policy_loss_function_composes_pg_entropy_and_kl():
    log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    entropy = torch.tensor([[0.5, 1.5]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0]])
    ref = torch.tensor([[-1.5, -2.0]])  # k1 = [0.5, 0]
    rollout = torch.tensor([[-1.25, -2.5]])
    loss, m = policy_loss_function(
        log_probs=log_probs, entropy=entropy, old_log_probs=log_probs.detach(), advantages=advantages,
        reduce=lambda x: x.sum(), eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.1, ref_log_probs=ref,
        kl_loss_coef=0.5, kl_loss_type="k1", rollout_log_probs=rollout)
    assert m["pg_loss"].item() == pytest.approx(-2.0)  # on policy: -Σ A
    assert m["entropy_loss"].item() == pytest.approx(2.0)
    assert m["kl_loss"].item() == pytest.approx(0.5)
    assert m["ppo_kl"].item() == 0.0 and m["pg_clipfrac"].item() == 0.0
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(0.25 + 0.5)
    assert loss.item() == pytest.approx(-2.0 - 0.1 * 2.0 + 0.5 * 0.5) == m["loss"].item()
    loss.backward()
    assert log_probs.grad[0].tolist() == pytest.approx([-1.0 + 0.5, -1.0 + 0.5])  # -A·ratio + kl_coef·dk1
    assert entropy.grad[0].tolist() == pytest.approx([-0.1, -0.1])


def test_zero_coefficients_keep_metrics_but_no_gradient():
    log_probs = torch.tensor([[-1.0]], requires_grad=True)
    entropy = torch.tensor([[0.7]], requires_grad=True)
    loss, m = policy_loss_function(
        log_probs=log_probs, entropy=entropy, old_log_probs=log_probs.detach(), advantages=torch.zeros(1, 1),
        reduce=lambda x: x.sum(), eps_clip=0.2, eps_clip_high=0.2, ref_log_probs=torch.tensor([[-3.0]]))
    assert m["kl_loss"].item() == pytest.approx(2.0) and m["entropy_loss"].item() == pytest.approx(0.7)
    assert "train_rollout_logprob_abs_diff" not in m
    loss.backward()
    assert log_probs.grad.item() == 0.0 and entropy.grad is None


def test_sft_loss_function_reduces_the_nll():
    log_probs = torch.tensor([[-1.0, -3.0, -7.0]])
    loss, m = sft_loss_function(log_probs=log_probs, reduce=lambda x: sum_of_token(x, torch.tensor([[1, 1, 0]])))
    assert loss.item() == 4.0 and m == {"loss": loss}
