"""slime.rollout.rm_hub.gpqa."""

from services.reward.rm.choice import gpqa_reward as compute_gpqa_reward

__all__ = ["compute_gpqa_reward"]
