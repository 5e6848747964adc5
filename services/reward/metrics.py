"""Prometheus metrics of the reward service (physarum_reward_*), in a registry of their own that its REST app serves
at /metrics: requests' latency and samples scored by scorer, and failures by type. `scorer` is the rm_type (without
slime's boxed_ prefix), "custom" for a custom_rm_path, "unknown" for a name no scorer has: a fixed label set,
whatever requests send."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.errors import InvalidArgument
from services.common.gen.physarum.v1 import sample_pb2
from services.common.samples import Sample
from services.common.settings.rewards import RM_TYPES
from services.reward import scorers
from services.reward.client import ScoreResult

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ERROR_TYPES = ("timeout", "exception", "bad_result", "invalid_request")


def error_type(result: ScoreResult) -> str:
    """What kind of failure a failed sample's error message reports (scorers.py writes them)."""
    if result.error.startswith("timed out"):
        return "timeout"
    if " returned " in result.error or "reward_key" in result.error:
        return "bad_result"
    return "exception"


class RewardMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.seconds = Histogram("physarum_reward_score_seconds", "time to score one request (all its samples)",
                                 ["scorer"], buckets=SECONDS_BUCKETS, registry=r)
        self.samples = Counter("physarum_reward_samples_total", "samples scored", ["scorer"], registry=r)
        self.errors = Counter("physarum_reward_errors_total", "samples or requests that failed, by failure type",
                              ["scorer", "type"], registry=r)

    async def score_samples(self, samples: Sequence[Sample | sample_pb2.Sample], *, rm_type: str, custom_rm_path: str,
                            **kwargs: Any) -> list[ScoreResult]:
        """scorers.score_samples, timed and counted."""
        base = rm_type.removeprefix("boxed_")
        scorer = "custom" if custom_rm_path else (base if base in RM_TYPES else "unknown")
        start = time.perf_counter()
        try:
            results = await scorers.score_samples(samples, rm_type=rm_type, custom_rm_path=custom_rm_path, **kwargs)
        except InvalidArgument:
            self.errors.labels(scorer, "invalid_request").inc()
            raise
        self.seconds.labels(scorer).observe(time.perf_counter() - start)
        self.samples.labels(scorer).inc(len(results))
        for result in results:
            if not result.ok:
                self.errors.labels(scorer, error_type(result)).inc()
        return results
