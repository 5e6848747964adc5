"""Prometheus metrics of the buffer (physarum_buffer_*), in a registry of their own served on metrics_port: what
waits in Redis (summed over jobs: prompts pending, active leases, stored groups), refreshed every few seconds, and
counters of what the RPCs move. No job ids in labels. Knows nothing of gRPC; the store stays metric-free."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from services.buffer.client import BufferStats
from services.buffer.store import BufferStore
from services.common.errors import NotFound
from services.common.samples import Prompt, SampleGroup

log = logging.getLogger(__name__)

JOB_META = "physarum:{*}:meta"  # one per job with a dataset (store.py's key layout)


class BufferMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.jobs = Gauge("physarum_buffer_jobs", "jobs with a dataset in Redis", registry=r)
        self.prompts_pending = Gauge(
            "physarum_buffer_prompts_pending", "prompts waiting to be leased for generation (the rest of each job's "
            "current epoch, plus returned and expired leases): the backlog of the rollout side", registry=r)
        self.leases_active = Gauge("physarum_buffer_leases_active", "prompts leased and not yet written back",
                                   registry=r)
        self.groups_stored = Gauge("physarum_buffer_groups_stored", "finished sample groups held for the trainer",
                                   registry=r)
        self.prompts_leased = Counter("physarum_buffer_prompts_leased_total", "prompts leased", registry=r)
        self.prompts_returned = Counter("physarum_buffer_prompts_returned_total", "leased prompts given back",
                                        registry=r)
        self.groups_written = Counter("physarum_buffer_groups_written_total", "sample groups written", registry=r)
        self.groups_duplicate = Counter("physarum_buffer_groups_duplicate_total",
                                        "sample groups written again (idempotent retries)", registry=r)
        self.groups_taken = Counter("physarum_buffer_groups_taken_total", "groups handed to the trainer", registry=r)
        self.groups_stale = Counter("physarum_buffer_groups_stale_total",
                                    "groups too old for the trainer's staleness bound, by what happened to them",
                                    ["action"], registry=r)
        for action in ("dropped", "regenerated"):
            self.groups_stale.labels(action)

    def set_backlog(self, stats: list[BufferStats]) -> None:
        self.jobs.set(len(stats))
        self.prompts_pending.set(sum(s.num_prompts - s.cursor + s.num_returned for s in stats))
        self.leases_active.set(sum(s.num_leased for s in stats))
        self.groups_stored.set(sum(s.num_groups for s in stats))


class MeteredStore(BufferStore):
    """The store, counting what each call moved."""

    def __init__(self, redis_url: str, metrics: BufferMetrics) -> None:
        super().__init__(redis_url)
        self.metrics = metrics
        self.stale_seen: dict[str, tuple[int, int]] = {}  # job -> (dropped, regenerated) totals last answered

    async def lease(self, job_id: str, rollout_id: int, count: int, lease_timeout_s: float) -> list[Prompt]:
        prompts = await super().lease(job_id, rollout_id, count, lease_timeout_s)
        self.metrics.prompts_leased.inc(len(prompts))
        return prompts

    async def return_prompts(self, job_id: str, lease_ids: list[str]) -> int:
        num_returned = await super().return_prompts(job_id, lease_ids)
        self.metrics.prompts_returned.inc(num_returned)
        return num_returned

    async def put_groups(self, groups: list[SampleGroup]) -> tuple[int, int]:
        num_written, num_duplicate = await super().put_groups(groups)
        self.metrics.groups_written.inc(num_written)
        self.metrics.groups_duplicate.inc(num_duplicate)
        return num_written, num_duplicate

    async def take_batch_encoded(self, job_id: str, *args, **kwargs) -> tuple[list[bytes], int, int]:
        # the server's path (take_batch decodes what this returns, so it is counted here once)
        groups, dropped, regenerated = await super().take_batch_encoded(job_id, *args, **kwargs)
        self.metrics.groups_taken.inc(len(groups))
        # the store answers the job's totals so far: count only what is new since the last take
        seen_dropped, seen_regenerated = self.stale_seen.get(job_id, (0, 0))
        self.metrics.groups_stale.labels("dropped").inc(max(0, dropped - seen_dropped))
        self.metrics.groups_stale.labels("regenerated").inc(max(0, regenerated - seen_regenerated))
        self.stale_seen[job_id] = (max(dropped, seen_dropped), max(regenerated, seen_regenerated))
        return groups, dropped, regenerated

    async def all_stats(self) -> list[BufferStats]:
        """Every job's stats (a job deleted meanwhile is skipped)."""
        stats = []
        async for key in self.redis.scan_iter(match=JOB_META, count=500):
            job_id = (key.decode() if isinstance(key, bytes) else key).split("{", 1)[1].rsplit("}", 1)[0]
            with contextlib.suppress(NotFound):
                stats.append(await self.stats(job_id))
        return stats


@dataclass
class MetricsExporter:
    """The HTTP endpoint (a thread of prometheus_client's) and the task refreshing the backlog gauges."""

    port: int
    task: asyncio.Task
    http: object = field(repr=False)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.http.shutdown()
        self.http.server_close()


async def start_exporter(store: MeteredStore, host: str, port: int, interval_s: float) -> MetricsExporter:
    """Serve /metrics on host:port (0: a free port) and refresh the backlog every interval_s."""
    http, _ = start_http_server(port, addr=host, registry=store.metrics.registry)

    async def refresh() -> None:
        while True:
            try:
                store.metrics.set_backlog(await store.all_stats())
            except Exception as err:  # noqa: BLE001 - a Redis outage must not end the metrics; health shows it
                log.warning("buffer metrics: backlog not refreshed: %s", err)
            await asyncio.sleep(interval_s)

    return MetricsExporter(port=http.server_port, task=asyncio.create_task(refresh()), http=http)
