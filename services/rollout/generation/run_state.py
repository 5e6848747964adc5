"""One rollout the manager runs: its generation, leases, counts and running statistics."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.gen.physarum.v1 import sample_pb2
from services.common.rollout_stats import RolloutStats
from services.common.samples import Prompt, Sample
from services.common.settings.rollout import RolloutConfig
from services.rollout.client import RolloutState
from services.rollout.generation.groups import Generation


@dataclass
class Run:
    """One rollout (job_id, rollout_id) this process started, with its running statistics."""

    gen: Generation
    rollout_id: int
    weight_version: str
    filter_fn: Callable[..., Any] | None = None
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    state: RolloutState = RolloutState.RUNNING
    num_groups_done: int = 0
    error: str = ""
    leased: dict[str, Prompt] = field(default_factory=dict)  # lease_id -> prompt not yet written or returned
    # lease_id -> the protos a scored group's samples were sent to the reward service as (rewards set): the write
    # stores those, so a sample is converted once
    encoded: dict[str, list[sample_pb2.Sample | None]] = field(default_factory=dict)
    stats: RolloutStats = field(default_factory=RolloutStats)
    num_failed_in_a_row: int = 0
    num_dropped_in_a_row: int = 0
    drops: collections.Counter[str] = field(default_factory=collections.Counter)
    extra_metrics: dict[str, float] = field(default_factory=dict)  # a rollout function's own (slime's metrics)
    task: asyncio.Task | None = None
    stopping: bool = False  # StopRollout cancelled it: it ends DONE, not FAILED

    @property
    def config(self) -> RolloutConfig:
        return self.gen.config

    @property
    def name(self) -> str:
        return f"rollout {self.rollout_id} of job {self.config.job_id}"

    def record(self, samples: list[Sample]) -> None:
        self.stats.add(samples)

    def metrics(self) -> dict[str, float]:
        metrics = {**self.extra_metrics, **{name: float(count) for name, count in self.drops.items()}}
        if not self.stats.num_samples:
            return metrics
        elapsed_s = max((self.finished_at or time.monotonic()) - self.started_at, 1e-9)
        return {**metrics, **self.stats.metrics(), "rollout/samples_per_second": self.stats.num_samples / elapsed_s}
