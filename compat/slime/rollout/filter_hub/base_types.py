"""slime.rollout.filter_hub.base_types: the rollout manager's own DynamicFilterOutput, so a filter's return value
is recognised as it is."""

from services.rollout.generation.filters import DynamicFilterOutput

__all__ = ["DynamicFilterOutput"]
