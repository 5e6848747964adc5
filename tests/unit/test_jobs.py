"""The job registry: FIFO on one worker, events with sequence numbers, cancel, failures kept apart."""

import threading
import time

import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.trainer.api.jobs import JobRegistry, JobState
from services.trainer.api.spec import parse_spec

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 2, "rollout_batch_size": 1}


def wait_terminal(registry, job_id, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not registry.get(job_id).state.terminal:
        assert time.monotonic() < deadline, f"job {job_id} did not finish"
        time.sleep(0.01)
    return registry.get(job_id)


def test_jobs_run_in_order_and_report_progress():
    order = []

    def runner(spec, ctx):
        for rollout_id in range(spec.num_rollout):
            ctx.report(rollout_id, {"rollout/reward_mean": rollout_id / 2})
        order.append(spec.job_id)

    registry = JobRegistry(runner)
    registry.submit(parse_spec({**BASE, "job_id": "a"}))
    registry.submit(parse_spec({**BASE, "job_id": "b"}))
    job = wait_terminal(registry, "b")
    assert order == ["a", "b"] and job.state == JobState.SUCCEEDED
    assert job.rollout_id == 1 and job.metrics == {"rollout/reward_mean": 0.5}
    events = registry.events_after("b", 0)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.state for e in events][-1] == JobState.SUCCEEDED
    assert [e.seq for e in registry.events_after("b", 2)] == [e.seq for e in events[2:]]
    registry.close()


def test_a_failing_job_is_failed_with_its_reason_and_the_next_runs():
    def runner(spec, ctx):
        if spec.job_id == "bad":
            raise ValueError("boom")

    registry = JobRegistry(runner)
    registry.submit(parse_spec({**BASE, "job_id": "bad"}))
    registry.submit(parse_spec({**BASE, "job_id": "good"}))
    assert wait_terminal(registry, "good").state == JobState.SUCCEEDED
    bad = registry.get("bad")
    assert bad.state == JobState.FAILED and bad.error == "ValueError: boom"
    registry.close()


def test_cancel_stops_a_running_job_and_a_queued_one():
    started = threading.Event()

    def runner(spec, ctx):
        started.set()
        while True:
            ctx.check_cancelled()
            time.sleep(0.01)

    registry = JobRegistry(runner)
    registry.submit(parse_spec({**BASE, "job_id": "running"}))
    registry.submit(parse_spec({**BASE, "job_id": "queued"}))
    assert started.wait(5)
    assert registry.cancel("queued").state == JobState.CANCELLED
    registry.cancel("running")
    assert wait_terminal(registry, "running").state == JobState.CANCELLED
    registry.close()


def test_duplicate_and_unknown_jobs_are_clear_errors():
    registry = JobRegistry(lambda spec, ctx: None)
    registry.submit(parse_spec({**BASE, "job_id": "x"}))
    with pytest.raises(FailedPrecondition, match="job 'x' already exists"):
        registry.submit(parse_spec({**BASE, "job_id": "x"}))
    with pytest.raises(NotFound, match="job 'nope' not found"):
        registry.get("nope")
    registry.close()


def test_the_rest_api_documents_the_job_spec_from_its_declarations():
    from services.trainer.api.rest import create_app

    registry = JobRegistry(lambda spec, ctx: None)
    try:
        body = create_app(registry).openapi()["paths"]["/v1/jobs"]["post"]["requestBody"]
    finally:
        registry.close()
    schema = body["content"]["application/json"]["schema"]
    assert {"hf_checkpoint", "prompt_data", "num_rollout", "rollout_batch_size"} <= set(schema["required"])
    assert schema["properties"]["label_key"] == {"default": "label", "title": "Label Key", "type": "string",
                                                 "description": "the label's key in each data row (slime's default)"}
    assert schema["properties"]["mode"]["enum"] == ["sync", "one_step_async", "fully_async"]


class WeirdBaseError(BaseException):
    """Like torch's CheckpointException: not an Exception."""


@pytest.mark.parametrize("raised", [WeirdBaseError("shard missing"), SystemExit(3), KeyboardInterrupt()])
def test_any_base_exception_fails_its_job_and_the_next_runs(raised):
    def runner(spec, ctx):
        if spec.job_id == "bad":
            raise raised

    registry = JobRegistry(runner)
    registry.submit(parse_spec({**BASE, "job_id": "bad"}))
    registry.submit(parse_spec({**BASE, "job_id": "good"}))
    assert wait_terminal(registry, "good").state == JobState.SUCCEEDED
    bad = registry.get("bad")
    assert bad.state == JobState.FAILED and bad.error.startswith(type(raised).__name__)
    assert registry.health() == ""
    registry.close()


def test_a_checkpoint_exception_becomes_one_line_per_failing_rank():
    from torch.distributed.checkpoint.api import CheckpointException

    from services.trainer.api.jobs import failure_reason

    try:
        raise ValueError("shard __0_0.distcp: unexpected end of file\nmore detail")
    except ValueError as err:
        cause = (err, None)
    err = CheckpointException("load failed", {1: cause, 0: (EOFError("truncated"), None)})
    assert failure_reason(err) == ("CheckpointException: rank 0: EOFError: truncated; "
                                   "rank 1: ValueError: shard __0_0.distcp: unexpected end of file")
    assert failure_reason(RuntimeError()) == "RuntimeError"


def test_health_names_a_worker_that_stopped_and_a_runner_out_of_step():
    registry = JobRegistry(lambda spec, ctx: None)
    assert registry.health() == ""
    registry._queue.put(None)  # the worker thread ends while the service still runs
    registry._worker.join(5)
    assert "job worker thread is not running" in registry.health()
    registry.close()
    assert registry.health() == ""  # closing is not being stuck

    class Broken:
        broken = "trainer ranks [1] did not finish job a"

        def __call__(self, spec, ctx):
            pass

    registry = JobRegistry(Broken())
    assert registry.health() == Broken.broken
    registry.close()


@pytest.mark.parametrize("max_restarts", [1, 0])
def test_a_lost_rank_queues_its_job_to_resume_starts_no_other_and_asks_the_process_to_exit(max_restarts):
    from services.trainer.driver.job import RanksLost

    def runner(spec, ctx):
        raise RanksLost("a collective between the trainer's ranks broke")

    registry = JobRegistry(runner, max_restarts=max_restarts)
    registry.submit(parse_spec({**BASE, "job_id": "lost"}))
    registry.submit(parse_spec({**BASE, "job_id": "behind"}))
    assert registry.ranks_lost.wait(5.0)
    lost = registry.get("lost")
    assert lost.attempts == 1 and lost.stalls == 1  # no checkpoint since it started: one in a row without progress
    if max_restarts:
        assert lost.state == JobState.QUEUED and lost.error == ""
        assert lost.transitions[-1].message.startswith("a trainer rank was lost: a collective")
        assert "(restart 1; 1 in a row without progress, at most 1)" in lost.transitions[-1].message
    else:  # no restart allowed: FAILED with the reason, as for a trainer that died
        assert lost.state == JobState.FAILED and "a trainer rank was lost while the job ran" in lost.error
    deadline = time.monotonic() + 5.0
    while not registry._queue.empty():  # the worker took the next job off the queue: it must not have started it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    assert registry.get("behind").state == JobState.QUEUED
    registry.close()


LORA = {**BASE, "lora_rank": 4, "lora_share_pool": True}


def test_lora_share_pool_jobs_of_one_base_run_side_by_side_and_a_full_weight_job_waits_for_them():
    """Jobs a, b (queued behind a before it started) and c (submitted while a runs) share a's base: all three run at
    once. d (another base) and e (full weights) wait in the queue until the group has ended, then run alone."""
    running, release = set(), threading.Event()
    seen_together, lock = [], threading.Lock()

    def runner(spec, ctx):
        with lock:
            running.add(spec.job_id)
            seen_together.append((spec.job_id, frozenset(running)))
        if spec.job_id in ("a", "b", "c"):
            assert release.wait(10)
        with lock:
            running.discard(spec.job_id)

    registry = JobRegistry(runner)
    registry.submit(parse_spec({**LORA, "job_id": "a"}))
    registry.submit(parse_spec({**LORA, "job_id": "b"}))
    registry.submit(parse_spec({**LORA, "job_id": "d", "hf_checkpoint": "/other"}))
    registry.submit(parse_spec({**BASE, "job_id": "e"}))
    deadline = time.monotonic() + 5
    while {"a", "b"} - running:
        assert time.monotonic() < deadline, f"a and b are not both running: {running}"
        time.sleep(0.01)
    registry.submit(parse_spec({**LORA, "job_id": "c"}))
    while "c" not in running:
        assert time.monotonic() < deadline, "c did not start beside a and b"
        time.sleep(0.01)
    assert registry.get("d").state == JobState.QUEUED and registry.get("e").state == JobState.QUEUED
    assert [j.job_id for j in registry.queue()] == ["a", "b", "c", "d", "e"]
    release.set()
    assert wait_terminal(registry, "e").state == JobState.SUCCEEDED
    assert all(registry.get(j).state == JobState.SUCCEEDED for j in "abcd")
    alone = dict(seen_together)
    assert alone["c"] == {"a", "b", "c"} and alone["d"] == {"d"} and alone["e"] == {"e"}
    registry.close()


def test_lora_share_pool_is_refused_for_full_weights_at_parse_and_on_a_trainer_of_several_ranks():
    with pytest.raises(Exception, match="lora_share_pool: a full-weight job"):
        parse_spec({**BASE, "lora_share_pool": True})
    registry = JobRegistry(lambda spec, ctx: None, share_pool=False)
    with pytest.raises(FailedPrecondition, match="lora_share_pool: this trainer has several ranks"):
        registry.submit(parse_spec({**LORA, "job_id": "a"}))
    registry.close()


def test_jobs_share_a_base_only_with_the_same_model_adapter_layers_dtype_and_engine_options():
    from services.trainer.driver.job import shared_base_key

    key = shared_base_key(parse_spec({**LORA, "lr": 1e-3, "lora_rank": 8}))  # rank and rollout settings: per job
    assert key == shared_base_key(parse_spec({**LORA, "rollout_batch_size": 2}))
    for other in ({"hf_checkpoint": "/other"}, {"target_modules": ["q_proj"]}, {"bf16": True},
                  {"slime_args": "--sglang-mem-fraction-static 0.5 --train-backend fsdp"}):
        assert shared_base_key(parse_spec({**LORA, **other})) != key, other
