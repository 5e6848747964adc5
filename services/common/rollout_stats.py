"""The rollout/* means of a rollout's samples, computed one way for the rollout manager (summed as groups finish)
and the trainer (on the rollout it trains on)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.common.samples import Sample, Status


@dataclass
class RolloutStats:
    num_samples: int = 0
    reward_sum: float = 0.0
    response_len_sum: int = 0
    num_truncated: int = 0

    @classmethod
    def of(cls, samples: Iterable[Sample]) -> RolloutStats:
        stats = cls()
        stats.add(samples)
        return stats

    def add(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            self.num_samples += 1
            self.reward_sum += s.reward
            self.response_len_sum += s.response_length
            self.num_truncated += s.status == Status.TRUNCATED

    def metrics(self) -> dict[str, float]:
        """rollout/reward_mean, response_len_mean and truncated_ratio; {} before any sample."""
        if not self.num_samples:
            return {}
        return {"rollout/reward_mean": self.reward_sum / self.num_samples,
                "rollout/response_len_mean": self.response_len_sum / self.num_samples,
                "rollout/truncated_ratio": self.num_truncated / self.num_samples}
