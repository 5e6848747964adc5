"""The algorithms' names by slime's flag values, without torch, so that a config can be validated before any model
loads: the advantage estimators, the KL estimators and which estimators shape rewards with KL."""

from __future__ import annotations

from typing import Literal, get_args

AdvantageEstimator = Literal["grpo", "gspo", "cispo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
KLLossType = Literal["k1", "k2", "k3", "low_var_kl"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
KL_LOSS_TYPES: tuple[str, ...] = get_args(KLLossType)
# Estimators that shape token rewards with -kl_coef·KL(π_old || π_ref); the GRPO family ignores kl_coef.
KL_REWARD_ESTIMATORS = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
