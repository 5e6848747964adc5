"""Approximate KL estimators between the policy and a reference, per token (slime's `compute_approx_kl`).

Schulman, "Approximating KL divergence": http://joschu.net/blog/kl-approx.html
"""

from __future__ import annotations

import torch

from services.trainer.algorithms.names import KL_LOSS_TYPES


def compute_approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, *, kl_loss_type: str,
                      importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(π || π_ref) estimate. log_probs, ref_log_probs: [B, T] -> [B, T] float32.

    With r = log π - log π_ref: k1 = r; k2 = r² / 2; k3 = low_var_kl = exp(-r) - 1 + r. importance_ratio
    (--use-unbiased-kl: π/π_old, DeepSeek-V3.2) multiplies the estimate; low_var_kl is then clamped to [-10, 10].
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio.square() / 2.0
    elif kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; valid: {', '.join(KL_LOSS_TYPES)}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(-10.0, 10.0) if kl_loss_type == "low_var_kl" else kl
