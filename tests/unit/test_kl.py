"""KL estimators k1, k2, k3, low_var_kl (and the unbiased, importance-weighted variant) against hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.algorithms.kl import KL_LOSS_TYPES, compute_approx_kl

LOG_PROBS = torch.tensor([[0.0, -1.0]])
REF_LOG_PROBS = torch.tensor([[-1.0, 0.0]])  # r = log π - log π_ref = [1, -1]


@pytest.mark.parametrize("kl_loss_type, expected", [
    ("k1", [1.0, -1.0]),
    ("k2", [0.5, 0.5]),
    ("k3", [math.exp(-1) - 1 + 1, math.exp(1) - 1 - 1]),
    ("low_var_kl", [math.exp(-1), math.e - 2]),
])
def test_estimators(kl_loss_type, expected):
    kl = compute_approx_kl(LOG_PROBS, REF_LOG_PROBS, kl_loss_type=kl_loss_type)
    assert kl.shape == (1, 2)
    assert kl[0].tolist() == pytest.approx(expected, rel=1e-6)


def test_low_var_kl_is_clamped_to_ten_and_k3_is_not():
    log_probs, ref = torch.tensor([-20.0]), torch.tensor([0.0])  # r = -20: exp(20) - 1 - 20
    assert compute_approx_kl(log_probs, ref, kl_loss_type="low_var_kl").item() == 10.0
    assert compute_approx_kl(log_probs, ref, kl_loss_type="k3").item() == pytest.approx(math.exp(20) - 21, rel=1e-6)


def test_all_estimators_are_zero_when_the_policies_agree():
    for kl_loss_type in KL_LOSS_TYPES:
        assert compute_approx_kl(LOG_PROBS, LOG_PROBS, kl_loss_type=kl_loss_type).abs().max().item() == 0.0


def test_k1_gradient_is_one_and_k3_gradient_is_one_minus_inverse_ratio():
    log_probs = torch.tensor([0.5], requires_grad=True)
    compute_approx_kl(log_probs, torch.tensor([0.0]), kl_loss_type="k1").sum().backward()
    assert log_probs.grad.item() == pytest.approx(1.0)
    log_probs.grad = None
    compute_approx_kl(log_probs, torch.tensor([0.0]), kl_loss_type="k3").sum().backward()
    assert log_probs.grad.item() == pytest.approx(1 - math.exp(-0.5))  # d/dr (e^-r - 1 + r)


@pytest.mark.parametrize("kl_loss_type", KL_LOSS_TYPES)
def test_unbiased_kl_multiplies_by_the_importance_ratio(kl_loss_type):
    plain = compute_approx_kl(LOG_PROBS, REF_LOG_PROBS, kl_loss_type=kl_loss_type)
    ratio = torch.tensor([[2.0, 0.5]])
    weighted = compute_approx_kl(LOG_PROBS, REF_LOG_PROBS, kl_loss_type=kl_loss_type, importance_ratio=ratio)
    assert weighted[0].tolist() == pytest.approx((plain * ratio)[0].tolist())


def test_low_var_kl_is_clamped_after_the_importance_ratio():
    log_probs, ref = torch.tensor([-3.0]), torch.tensor([0.0])  # k3 = e^3 - 1 - 3 = 16.09
    weighted = compute_approx_kl(log_probs, ref, kl_loss_type="low_var_kl", importance_ratio=torch.tensor([0.5]))
    assert weighted.item() == pytest.approx(0.5 * (math.exp(3) - 4), rel=1e-6)  # 8.04, not min(16.09, 10)·0.5


def test_kl_loss_types_match_the_config_names():
    from services.trainer.settings import train

    assert train.KL_LOSS_TYPES == KL_LOSS_TYPES


def test_unknown_type_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown kl_loss_type 'k4'; valid: k1, k2, k3, low_var_kl"):
        compute_approx_kl(LOG_PROBS, REF_LOG_PROBS, kl_loss_type="k4")
