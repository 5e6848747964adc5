"""Log-probs/entropy, the policy losses (PPO clip, dual clip, GSPO, CISPO, TIS), KL and entropy terms, the value
and SFT losses and the reducers, against hand-derived numbers and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.algorithms.losses import (
    compute_cispo_loss,
    compute_gspo_kl,
    compute_policy_loss,
    policy_loss_function,
    sft_loss,
    sft_loss_function,
    sum_of_sample_mean,
    sum_of_token,
    tis_weights,
    token_log_probs_and_entropy,
    value_loss,
    value_loss_function,
)


def total(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def test_log_probs_and_entropy_of_a_two_token_vocab():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # softmax [1/4, 3/4]
    log_probs, entropy = token_log_probs_and_entropy(logits, torch.tensor([[1]]))
    assert log_probs.shape == entropy.shape == (1, 1)
    assert log_probs.item() == pytest.approx(math.log(0.75))
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    assert token_log_probs_and_entropy(logits, torch.tensor([[1]]), with_entropy=False)[1] is None


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


def test_symmetric_clip():
    log_ratio = RATIOS.log().requires_grad_()
    loss, clipfrac = compute_policy_loss(-log_ratio, ADVANTAGES, eps_clip=0.2, eps_clip_high=0.2)
    assert loss[0].tolist() == pytest.approx([-1.2, -0.5, 0.8, 1.5, -1.2])
    assert clipfrac[0].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    loss.sum().backward()
    # unclipped tokens: d(-ratio·A)/d log π = -ratio·A; clipped tokens carry no gradient
    assert log_ratio.grad[0].tolist() == pytest.approx([0.0, -0.5, 0.0, 1.5, 0.0])


def test_clip_higher_widens_only_the_upper_bound():
    loss, clipfrac = compute_policy_loss(-RATIOS.log(), ADVANTAGES, eps_clip=0.2, eps_clip_high=0.28)
    assert loss[0].tolist() == pytest.approx([-1.28, -0.5, 0.8, 1.5, -1.25])
    assert clipfrac[0].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_dual_clip_slimes_hand_case():
    ratio, advantages = torch.tensor([1.5, 4.0, 1.0]), torch.tensor([2.0, -1.0, 1.0])
    loss, _ = compute_policy_loss(-ratio.log(), advantages, eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=3.0)
    # max(-3, -2.4) = -2.4; A < 0: min(max(4, 1.2), 3) = 3; on-policy -1
    assert loss.tolist() == pytest.approx([-2.4, 3.0, -1.0])


def test_dual_clip_binds_only_large_ratios_of_negative_advantages():
    log_ratio = torch.tensor([0.5, 5.0, 5.0]).log().requires_grad_()
    advantages = torch.tensor([-2.0, -2.0, 2.0])
    loss, clipfrac = compute_policy_loss(-log_ratio, advantages, eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=3.0)
    # a: max(1.0, 0.8·2 = 1.6) = 1.6 < 3·2; b: max(10, 2.4) = 10 -> min(10, 6) = 6; c: A > 0: max(-10, -2.4) = -2.4
    assert loss.tolist() == pytest.approx([1.6, 6.0, -2.4])
    assert clipfrac.tolist() == [1.0, 0.0, 1.0]
    loss.sum().backward()
    assert log_ratio.grad.tolist() == [0.0, 0.0, 0.0]  # every term is a clipped constant
    without, _ = compute_policy_loss(torch.tensor([-math.log(5.0)]), torch.tensor([-2.0]), eps_clip=0.2,
                                     eps_clip_high=0.2)
    assert without.item() == pytest.approx(10.0)
    with pytest.raises(ValueError, match="eps_clip_c .* must be > 1"):
        compute_policy_loss(log_ratio, advantages, eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=1.0)


def test_on_policy_ppo_loss_is_minus_advantage():
    loss, clipfrac = compute_policy_loss(torch.zeros(1, 5), ADVANTAGES, eps_clip=0.2, eps_clip_high=0.2)
    assert loss.tolist() == (-ADVANTAGES).tolist() and clipfrac.sum().item() == 0.0


def test_cispo_gradient_flows_only_through_log_probs():
    log_ratio = torch.tensor([0.5, 1.0, 3.0]).log().requires_grad_()
    log_probs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 2.0])
    loss, clipfrac = compute_cispo_loss(-log_ratio, log_probs, advantages, eps_clip=0.2, eps_clip_high=1.0)
    # clip(ratio, 0.8, 2.0) = [0.8, 1.0, 2.0]; loss = -w·A·log π
    assert loss.tolist() == pytest.approx([0.8, -2.0, 2.0])
    assert clipfrac.tolist() == [1.0, 0.0, 1.0]
    loss.sum().backward()
    assert log_probs.grad.tolist() == pytest.approx([-0.8, 1.0, -4.0])  # clipped tokens keep a gradient
    assert log_ratio.grad is None or log_ratio.grad.abs().sum().item() == 0.0


def test_gspo_ratio_is_the_sequence_geometric_mean():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]])
    log_probs = (old - torch.tensor([[0.1, 0.3, 5.0], [-0.4, -0.2, 0.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    ppo_kl = compute_gspo_kl(log_probs, old, mask)
    # masked means of old - new: row 0 (0.1 + 0.3) / 2 = 0.2 (the masked 5.0 is ignored), row 1 -0.3
    assert ppo_kl.tolist() == [pytest.approx([0.2] * 3), pytest.approx([-0.3] * 3)]
    loss, clipfrac = compute_policy_loss(ppo_kl, torch.ones(2, 3), eps_clip=0.1, eps_clip_high=0.1)
    # row 0: ratio e^-0.2 = 0.819 < 0.9 with A > 0: unclipped; row 1: e^0.3 = 1.35 > 1.1: clipped at the sequence
    assert loss[0].tolist() == pytest.approx([-math.exp(-0.2)] * 3) and clipfrac[0].tolist() == [0.0] * 3
    assert loss[1].tolist() == pytest.approx([-1.1] * 3) and clipfrac[1].tolist() == [1.0] * 3
    sum_of_token(loss, mask).backward()
    # d/d log π_t of Σ_t' -exp(mean(new - old)): -ratio / 2 per token, twice -> -ratio on each unmasked token
    assert log_probs.grad[0].tolist() == pytest.approx([-math.exp(-0.2), -math.exp(-0.2), 0.0])
    assert log_probs.grad[1].tolist() == [0.0, 0.0, 0.0]


def test_tis_clamps_the_train_rollout_ratio_and_reports_it():
    train = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]])
    weights, metrics = tis_weights(train, torch.zeros(1, 3), tis_clip=2.0, tis_clip_low=0.6)
    assert weights[0].tolist() == pytest.approx([2.0, 0.6, 1.0])
    assert metrics["tis"][0].tolist() == pytest.approx([3.0, 0.5, 1.0])
    assert metrics["tis_clipfrac"][0].tolist() == [1.0, 1.0, 0.0]
    assert metrics["tis_abs"][0].tolist() == pytest.approx([2.0, 0.5, 0.0])


def test_tis_in_the_policy_loss_weights_each_tokens_pg_loss():
    log_probs = torch.zeros(1, 3, requires_grad=True)
    rollout = -torch.tensor([[math.log(3.0), math.log(0.5), 0.0]])  # train/rollout ratio [3, 0.5, 1]
    loss, m = policy_loss_function(
        log_probs=log_probs, entropy=torch.zeros(1, 3), old_log_probs=None, advantages=torch.ones(1, 3),
        loss_mask=torch.ones(1, 3), reduce=total, use_tis=True, tis_clip=2.0, tis_clip_low=0.6,
        rollout_log_probs=rollout)
    assert m["pg_loss"].item() == pytest.approx(-(2.0 + 0.6 + 1.0))
    assert m["tis"].item() == pytest.approx(4.5) and m["tis_clipfrac"].item() == 2.0
    assert m["tis_abs"].item() == pytest.approx(2.5) and m["ois"].item() == pytest.approx(3.0)  # ratio 1 per token
    loss.backward()
    assert log_probs.grad[0].tolist() == pytest.approx([-2.0, -0.6, -1.0])


def test_value_loss_clipping():
    values = torch.tensor([1.1, 0.5, 2.0], requires_grad=True)
    loss, clipfrac = value_loss(values, torch.ones(3), torch.tensor([2.0, 0.0, 1.0]), value_clip=0.2)
    # a: inside the clip, (1.1 - 2)²; b: v_clip 0.8: max(0.64, 0.25); c: v_clip 1.2: max(0.04, 1.0)
    assert loss.tolist() == pytest.approx([0.81, 0.64, 1.0])
    assert clipfrac.tolist() == [0.0, 1.0, 1.0]
    loss.sum().backward()
    assert values.grad.tolist() == pytest.approx([-1.8, 0.0, 2.0])  # b's larger term is the clipped constant


def test_value_loss_function_reduces_loss_and_clipfrac():
    loss, m = value_loss_function(values=torch.tensor([[1.1, 0.5, 2.0]]), old_values=torch.ones(1, 3),
                                  returns=torch.tensor([[2.0, 0.0, 1.0]]), reduce=lambda x: x.mean(),
                                  value_clip=0.2)
    assert loss.item() == pytest.approx((0.81 + 0.64 + 1.0) / 3) == m["value_loss"].item()
    assert m["value_clipfrac"].item() == pytest.approx(2 / 3)


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
    ref = torch.tensor([[-1.5, -2.0]])  # k1 = [0.5, 0]
    rollout = torch.tensor([[-1.25, -2.5]])
    loss, m = policy_loss_function(
        log_probs=log_probs, entropy=entropy, old_log_probs=log_probs.detach(), advantages=torch.ones(1, 2),
        loss_mask=torch.ones(1, 2), reduce=total, eps_clip=0.2, eps_clip_high=0.2, entropy_coef=0.1,
        ref_log_probs=ref, kl_loss_coef=0.5, kl_loss_type="k1", rollout_log_probs=rollout)
    assert m["pg_loss"].item() == pytest.approx(-2.0)  # on policy: -Σ A
    assert m["entropy_loss"].item() == pytest.approx(2.0)
    assert m["kl_loss"].item() == pytest.approx(0.5)
    assert m["ppo_kl"].item() == 0.0 and m["pg_clipfrac"].item() == 0.0
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(0.25 + 0.5)
    assert "tis" not in m and "ois" not in m
    assert loss.item() == pytest.approx(-2.0 - 0.1 * 2.0 + 0.5 * 0.5) == m["loss"].item()
    loss.backward()
    assert log_probs.grad[0].tolist() == pytest.approx([-1.0 + 0.5, -1.0 + 0.5])  # -A·ratio + kl_coef·dk1
    assert entropy.grad[0].tolist() == pytest.approx([-0.1, -0.1])


@pytest.mark.parametrize("kl_loss_type, expected", [
    ("k1", 1.0 - 1.0), ("k2", 0.5 + 0.5), ("k3", math.exp(-1) + math.e - 2), ("low_var_kl", math.exp(-1) + math.e - 2),
])
def test_kl_loss_of_each_type(kl_loss_type, expected):
    log_probs = torch.tensor([[0.0, -1.0]])  # r = log π - log π_ref = [1, -1]
    _, m = policy_loss_function(log_probs=log_probs, entropy=torch.zeros(1, 2), old_log_probs=None,
                                advantages=torch.zeros(1, 2), loss_mask=torch.ones(1, 2), reduce=total,
                                ref_log_probs=torch.tensor([[-1.0, 0.0]]), kl_loss_coef=1.0, kl_loss_type=kl_loss_type)
    assert m["kl_loss"].item() == pytest.approx(expected)


def test_unbiased_kl_loss_is_weighted_by_the_current_over_old_ratio():
    log_probs = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-math.log(2.0)]])  # π / π_old = 2
    loss, m = policy_loss_function(log_probs=log_probs, entropy=torch.zeros(1, 1), old_log_probs=old,
                                   advantages=torch.zeros(1, 1), loss_mask=torch.ones(1, 1), reduce=total,
                                   ref_log_probs=torch.tensor([[-1.0]]), kl_loss_coef=1.0, kl_loss_type="k2",
                                   use_unbiased_kl=True)
    assert m["kl_loss"].item() == pytest.approx(2.0 * 0.5)  # ratio · r²/2 with r = 1
    loss.backward()
    assert log_probs.grad.item() == pytest.approx(2.0 * 0.5 + 2.0 * 1.0)  # d(ratio·r²/2) = ratio·r²/2 + ratio·r


def test_zero_coefficients_keep_metrics_but_no_gradient():
    log_probs = torch.tensor([[-1.0]], requires_grad=True)
    entropy = torch.tensor([[0.7]], requires_grad=True)
    loss, m = policy_loss_function(
        log_probs=log_probs, entropy=entropy, old_log_probs=log_probs.detach(), advantages=torch.zeros(1, 1),
        loss_mask=torch.ones(1, 1), reduce=total, ref_log_probs=torch.tensor([[-3.0]]))
    assert m["kl_loss"].item() == pytest.approx(2.0) and m["entropy_loss"].item() == pytest.approx(0.7)
    assert "train_rollout_logprob_abs_diff" not in m
    loss.backward()
    assert log_probs.grad.item() == 0.0 and entropy.grad is None


def test_policy_loss_function_picks_the_estimators_surrogate():
    log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]]) - math.log(3.0)  # ratio 3 on both tokens
    common = {"entropy": torch.zeros(1, 2), "old_log_probs": old, "advantages": torch.ones(1, 2),
              "loss_mask": torch.ones(1, 2), "reduce": total, "eps_clip": 0.2, "eps_clip_high": 0.2}
    _, ppo = policy_loss_function(log_probs=log_probs, advantage_estimator="grpo", **common)
    _, cispo = policy_loss_function(log_probs=log_probs, advantage_estimator="cispo", **common)
    assert ppo["pg_loss"].item() == pytest.approx(-2.4)  # clipped at 1.2 on both tokens
    assert cispo["pg_loss"].item() == pytest.approx(-1.2 * (-1.0 - 2.0))  # -1.2·A·log π summed
    assert ppo["pg_clipfrac"].item() == cispo["pg_clipfrac"].item() == 2.0


def test_rollout_logprobs_as_old_policy_compare_the_current_log_probs():
    log_probs = torch.tensor([[-1.0]])
    rollout = torch.tensor([[-1.5]])
    _, m = policy_loss_function(log_probs=log_probs, entropy=torch.zeros(1, 1), old_log_probs=rollout,
                                advantages=torch.ones(1, 1), loss_mask=torch.ones(1, 1), reduce=total,
                                rollout_log_probs=rollout, use_rollout_logprobs=True)
    assert m["ppo_kl"].item() == pytest.approx(-0.5)
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(0.5)


def test_sft_loss_function_reduces_the_nll():
    log_probs = torch.tensor([[-1.0, -3.0, -7.0]])
    loss, m = sft_loss_function(log_probs=log_probs, reduce=lambda x: sum_of_token(x, torch.tensor([[1, 1, 0]])))
    assert loss.item() == 4.0 and m == {"loss": loss}


def test_entropy_as_a_metric_keeps_no_graph():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.zeros(2, 3, dtype=torch.long)
    log_probs, metric = token_log_probs_and_entropy(logits, targets, entropy_grad=False)
    _, trained = token_log_probs_and_entropy(logits, targets)
    assert log_probs.requires_grad and not metric.requires_grad and trained.requires_grad
    assert torch.equal(metric, trained.detach())
