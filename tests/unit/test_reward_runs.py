"""A request's samples go to the reward workers as Runs (one message per run, each sample's Task built in the worker),
through one queue per request: what a Run reads as, and that a run's failures stay its samples' own."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import InvalidArgument
from services.common.samples import Sample, sample_to_proto
from services.reward.workers import Run, WorkerPool

PLUGINS = "tests.plugins.reward_fns"


def test_a_run_of_protos_reads_as_the_tasks_of_its_samples():
    samples = [Sample(response="46", label="46", index=10),
               Sample(response="1", index=11, custom_rm_path=f"{PLUGINS}.boom"),
               Sample(response="2", index=12)]
    sent = [sample_to_proto(s).SerializeToString() for s in samples]
    builtin = Run("exact_match", "", "", {}, sent)
    assert [(t.kind, t.target, t.request_path, t.index) for t in builtin] == [
        ("builtin", "exact_match", False, 10), ("custom", f"{PLUGINS}.boom", False, 11),
        ("builtin", "exact_match", False, 12)]
    # the request's custom_rm_path wins over rm_type, a sample's own over the request's; only the request's is the
    # request's code (code it cannot load fails the request)
    custom = Run("exact_match", f"{PLUGINS}.scaled_match", "score", {"scale": 2}, sent)
    assert [(t.kind, t.target, t.request_path, t.reward_key, t.args) for t in custom] == [
        ("custom", f"{PLUGINS}.scaled_match", True, "score", {"scale": 2}),
        ("custom", f"{PLUGINS}.boom", False, "score", {"scale": 2}),
        ("custom", f"{PLUGINS}.scaled_match", True, "score", {"scale": 2})]
    tail = custom[1:]
    assert isinstance(tail, Run) and len(tail) == 2 and tail[0].index == 11
    assert Run("math", "", "", {}, samples)[2].sample is samples[2]  # a record goes as it is


def run_all(pool: WorkerPool, runs: list[Run], timeout_s: float = 5.0, slots: int = 8):
    async def run():
        return await pool.run_all(runs, timeout_s, asyncio.Semaphore(slots))
    return asyncio.run(run())


def test_runs_come_back_in_order_and_a_sample_that_kills_its_worker_fails_alone():
    def sample(i: int) -> bytes:
        own = f"{PLUGINS}.dies" if i == 4 else ""
        return sample_to_proto(Sample(response="46" if i % 2 else "0", label="46", index=i,
                                      custom_rm_path=own)).SerializeToString()
    # a plain reward comes back as its 8 bytes, bit for bit; a failure as JSON
    runs = [Run("", f"{PLUGINS}.scaled_match", "", {"scale": 0.3}, [sample(i) for i in range(start, start + 3)])
            for start in (0, 3, 6)]
    pool = WorkerPool(num_workers=2)
    try:
        outcomes = run_all(pool, runs)
    finally:
        pool.close()
    assert [[o.reward for o in run] for run in outcomes] == [[0.0, 0.3, 0.0], [0.3, 0.0, 0.3], [0.0, 0.3, 0.0]]
    assert [o.ok for run in outcomes for o in run] == [True] * 4 + [False] + [True] * 4
    assert outcomes[1][1].error == f"custom_rm_path {PLUGINS}.dies: worker exited (code 7) while scoring"


def test_a_run_naming_unloadable_code_fails_the_request_and_its_runs_not_yet_started_are_not_scored():
    # two workers: one takes the bad run, the other a slow one; the third run's sample would kill the worker that
    # took it (its own custom_rm_path wins), so an unchanged set of worker processes shows no one took it
    runs = [Run("", f"{PLUGINS}.missing", "", {}, [Sample(index=0)]),
            Run("", f"{PLUGINS}.slow", "", {"sleep_s": 3.0}, [Sample(index=1)]),
            Run("", f"{PLUGINS}.missing", "", {}, [Sample(index=2, custom_rm_path=f"{PLUGINS}.dies")])]
    pool = WorkerPool(num_workers=2)
    try:
        asyncio.run(pool.start())
        worker_pids = {w.process.pid for w in pool._idle}
        with pytest.raises(InvalidArgument, match="has no function 'missing'"):
            run_all(pool, runs)
        deadline = time.monotonic() + 60
        while len(pool._idle) < 2 and time.monotonic() < deadline:  # the slow run ends after the request failed
            time.sleep(0.05)
        assert {w.process.pid for w in pool._idle} == worker_pids
        good = Run("", f"{PLUGINS}.scaled_match", "", {"scale": 1}, [Sample(response="4", label="4")])
        assert [[o.reward for o in run] for run in run_all(pool, [good])] == [[1.0]]
    finally:
        pool.close()
