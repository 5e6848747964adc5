"""slime.rollout.rm_hub.f1."""

from services.reward.rm.text import f1_parts as f1_score
from services.reward.rm.text import normalize_answer

__all__ = ["f1_score", "normalize_answer"]
