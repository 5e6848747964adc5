"""The buffer's stale-group counters count each stale group once: TakeBatch answers the job's totals so far, so the
counters grow by what is new since the last take of that job."""

from __future__ import annotations

import asyncio

from services.buffer import metrics as buffer_metrics
from services.buffer.store import BufferStore


def test_stale_counters_grow_by_the_new_part_of_the_jobs_totals(monkeypatch):
    answers = iter([([b"g"], 2, 1), ([b"g"], 2, 1), ([], 5, 1), ([b"g"], 1, 0)])  # job-a, job-a, job-a, job-b

    async def take(self, job_id, *args, **kwargs):
        return next(answers)

    monkeypatch.setattr(BufferStore, "take_batch_encoded", take)
    metrics = buffer_metrics.BufferMetrics()
    store = buffer_metrics.MeteredStore("redis://127.0.0.1:1/0", metrics)  # never connects: the parent is stubbed

    async def main() -> None:
        for job in ("job-a", "job-a", "job-a", "job-b"):
            await store.take_batch_encoded(job, 0, 1)

    asyncio.run(main())
    value = metrics.registry.get_sample_value
    assert value("physarum_buffer_groups_stale_total", {"action": "dropped"}) == 5 + 1  # not 2 + 2 + 5 + 1
    assert value("physarum_buffer_groups_stale_total", {"action": "regenerated"}) == 1 + 0
    assert value("physarum_buffer_groups_taken_total") == 3
