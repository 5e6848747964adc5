"""slime.rollout.rm_hub.deepscaler."""

from services.reward.rm.math import deepscaler_reward as get_deepscaler_rule_based_reward

__all__ = ["get_deepscaler_rule_based_reward"]
