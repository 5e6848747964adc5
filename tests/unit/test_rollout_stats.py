"""rollout/* means: the same numbers whether summed group by group (the manager) or over the rollout (the trainer)."""

from __future__ import annotations

from services.common.rollout_stats import RolloutStats
from services.common.samples import Sample, Status


def sample(reward: float, length: int, status: Status = Status.COMPLETED) -> Sample:
    return Sample(reward=reward, response_length=length, status=status)


def test_means_summed_by_group_equal_those_of_the_whole_rollout():
    groups = [[sample(1.0, 4), sample(0.0, 2, Status.TRUNCATED)], [sample(0.5, 6), sample(0.5, 8)]]
    running = RolloutStats()
    for group in groups:
        running.add(group)
    whole = RolloutStats.of(s for g in groups for s in g)
    assert running.metrics() == whole.metrics() == {"rollout/reward_mean": 0.5, "rollout/response_len_mean": 5.0,
                                                    "rollout/truncated_ratio": 0.25}
    assert RolloutStats().metrics() == {}
