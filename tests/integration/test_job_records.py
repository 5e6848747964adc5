"""Job records in a real Redis: a job API started again answers list, get, history and cancel as the one before
it did; jobs wait in a visible queue; a queued job can be cancelled; the list filters by state; an unfinished job
resumes with `load` set to its own `save`; a job the trainer dies in too often becomes FAILED."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from services.common import procs
from services.common.errors import InvalidArgument, Unauthenticated
from services.trainer.api.client import JobsClient, JobsRestClient
from services.trainer.api.config import TrainerConfig
from services.trainer.api.job_store import RedisJobStore
from services.trainer.api.jobs import JobRegistry, JobState
from services.trainer.api.server import create_server
from services.trainer.api.spec import parse_spec


@pytest.fixture
def redis_url(tmp_path):
    """A Redis of this test's own: the job records are global keys."""
    proc, url = procs.start_redis(tmp_path / "redis")
    yield url
    proc.stop()


class Runner:
    """Runs each job a rollout at a time until `release` is set, checking cancellation like the loop does; records
    the spec each run got."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.runs: list[tuple[str, str]] = []  # (job_id, load)

    def __call__(self, spec, ctx) -> None:
        self.runs.append((spec.job_id, spec.load))
        self.started.set()
        for rollout_id in range(spec.num_rollout):
            while spec.job_id == "first" and not self.release.is_set():
                ctx.check_cancelled()
                time.sleep(0.01)
            ctx.check_cancelled()
            ctx.report(rollout_id, {"rollout/reward_mean": rollout_id / 4, "perf/save_seconds": 0.1})


class Api:
    def __init__(self, config: TrainerConfig, runner) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers = asyncio.run_coroutine_threadsafe(create_server(config, runner), self.loop).result(60)
        self.url = f"http://127.0.0.1:{self.servers.rest.port}"
        self.grpc = f"127.0.0.1:{self.servers.grpc.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.servers.stop(1.0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def spec(tmp_path: Path, job_id: str, **keys) -> dict:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    return {"hf_checkpoint": str(tmp_path / "m"), "prompt_data": str(tmp_path / "d.jsonl"), "num_rollout": 3,
            "rollout_batch_size": 1, "job_id": job_id, **keys}


def wait_state(client, job_id: str, state: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (job := client.get(job_id))["state"] != state:
        assert time.monotonic() < deadline, f"job {job_id} is {job['state']}, not {state}"
        time.sleep(0.05)
    return job


def test_records_survive_a_restart_and_the_unfinished_job_resumes_first(redis_url, tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("0\n")  # the first job's checkpoint of rollout 0
    config = TrainerConfig(port=0, rest_port=0, jobs_redis_url=redis_url)
    runner = Runner()
    api = Api(config, runner)
    with JobsRestClient(api.url) as client:
        client.submit(spec(tmp_path, "first", save=str(save)))
        client.submit(spec(tmp_path, "second"))
        client.submit(spec(tmp_path, "third"))
        assert runner.started.wait(30)
        assert [j["job_id"] for j in client.queue()] == ["first", "second", "third"]
        assert client.cancel("third")["state"] == "CANCELLED"
        assert [j["job_id"] for j in client.list("QUEUED")] == ["second"]
        with pytest.raises(InvalidArgument, match="state 'DONE': expected one of QUEUED, RUNNING"):
            client.list("DONE")
        before = {j["job_id"]: j for j in client.list()}
        history = client.events("first")
    api.stop()  # SIGTERM's path: the running job is preempted, unfinished
    assert runner.runs == [("first", "")]

    runner2 = Runner()
    runner2.release.set()
    api = Api(config, runner2)
    try:
        with JobsRestClient(api.url) as client, JobsClient(api.grpc) as grpc_client:
            assert wait_state(client, "second", "SUCCEEDED")["rollout_id"] == 2
            first = client.get("first")
            assert first["state"] == "SUCCEEDED" and first["checkpoints"] == [0, 1, 2]
            assert runner2.runs == [("first", str(save)), ("second", "")]  # resumed from its own save, then next
            assert client.events("first")[:len(history)] == history  # the history before the restart, kept
            reasons = [(t["state"], t["reason"]) for t in first["transitions"]]
            assert reasons[:2] == [("QUEUED", "queued"), ("RUNNING", "running")]
            assert reasons[2][0] == "QUEUED" and reasons[2][1].startswith("preempted: the trainer stopped")
            assert reasons[3:] == [("RUNNING", "running (resumed)"), ("SUCCEEDED", "finished")]
            third = client.get("third")
            assert {k: third[k] for k in ("state", "created_at", "spec")} == \
                {k: before["third"][k] for k in ("state", "created_at", "spec")}
            assert client.cancel("third")["state"] == "CANCELLED"
            assert [j["job_id"] for j in client.list()] == ["first", "second", "third"]
            assert [j["job_id"] for j in grpc_client.list("SUCCEEDED")] == ["first", "second"]
            assert grpc_client.get("first")["checkpoints"] == [0, 1, 2]
    finally:
        api.stop()


def test_a_job_the_trainer_died_in_resumes_until_the_restart_limit(redis_url, tmp_path):
    """No close: the first registry stands for a trainer that was SIGKILLed with its job RUNNING."""
    blocked = threading.Event()

    def hangs(spec, ctx) -> None:
        blocked.wait(60)

    dead = JobRegistry(hangs, RedisJobStore(redis_url))
    dead.submit(parse_spec(spec(tmp_path, "crashy")))
    deadline = time.monotonic() + 30
    while dead.get("crashy").state != JobState.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert dead._store.flush()
    try:
        for attempt in (1, 2):
            registry = JobRegistry(hangs, RedisJobStore(redis_url), max_restarts=2)
            job = registry.get("crashy")
            assert job.attempts == attempt
            assert any(f"it resumes from its latest checkpoint (restart {attempt}; {attempt} in a row without "
                       f"progress, at most 2)" in e.message for e in job.events)
            deadline = time.monotonic() + 30
            while job.state != JobState.RUNNING:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert registry._store.flush()
        final = JobRegistry(hangs, RedisJobStore(redis_url), max_restarts=2).get("crashy")
        assert final.state == JobState.FAILED and final.attempts == 3
        assert final.error == ("the trainer stopped while the job ran (at rollout -1), 3 times in a row without "
                               "progress (at most 2 restarts): not resumed again")
    finally:
        blocked.set()


def wait_job(registry: JobRegistry, job_id: str, *states: JobState):
    deadline = time.monotonic() + 30
    while (job := registry.get(job_id)).state not in states:
        assert time.monotonic() < deadline, f"job {job_id} is {job.state}, not {states}"
        time.sleep(0.01)
    return job


def died(redis_url: str, runner, max_restarts: int) -> JobRegistry:
    """A job API started again after its trainer was SIGKILLed (the registry before it is left unclosed)."""
    return JobRegistry(runner, RedisJobStore(redis_url), max_restarts=max_restarts)


def test_every_kind_of_interruption_counts_and_progress_resets_the_count(redis_url, tmp_path):
    """Deaths (SIGKILL) and evictions (SIGTERM) count together; a new checkpoint (a death) or a trained rollout
    (an eviction, which checkpoints it) since the start before resets the count; one interruption too many in a
    row without progress ends the job FAILED saying how it stopped, each time at the same rollout."""
    plan: list[str] = []  # what each run does: "checkpoint" (reports rollout n with a checkpoint) then waits
    progress = {"rollout": -1}
    released = threading.Event()

    def runner(spec, ctx) -> None:
        if plan.pop(0) == "checkpoint":
            progress["rollout"] += 1
            ctx.report(progress["rollout"], {"perf/save_seconds": 0.1})
        while not released.wait(0.01):
            ctx.check_cancelled()  # an eviction stops the job here

    def run_then(registry: JobRegistry, how: str) -> JobRegistry:
        """The job runs in `registry`, then the trainer dies (SIGKILL) or is evicted (SIGTERM)."""
        wait_job(registry, "flaky", JobState.RUNNING)
        assert registry._store.flush()
        if how == "evict":
            registry.close()
        return died(redis_url, runner, max_restarts=2)

    plan.extend(["checkpoint", "checkpoint", "wait", "checkpoint", "wait", "wait", "wait"])
    registry = died(redis_url, runner, max_restarts=2)
    registry.submit(parse_spec(spec(tmp_path, "flaky", num_rollout=10)))
    stalls = []
    for how in ("kill", "evict", "kill", "evict", "evict", "evict", "kill"):
        registry = run_then(registry, how)
        stalls.append(registry.get("flaky").stalls)
        if registry.get("flaky").state == JobState.FAILED:
            break
    # kill after a checkpoint: 0; evict after a trained rollout: 0; kill with nothing new: 1; evict after a
    # trained rollout: 0; evict, evict with nothing new: 1, 2; kill with nothing new: 3 > 2, FAILED
    assert stalls == [0, 0, 1, 0, 1, 2, 3]
    final = registry.get("flaky")
    assert final.state == JobState.FAILED and final.attempts == 3 and final.checkpoints == [0, 1, 2]
    assert final.error == ("the trainer stopped while the job ran (at rollout 2), 3 times in a row without progress "
                           "(at most 2 restarts): not resumed again")
    released.set()
    registry.close()


def test_a_resumed_job_that_raises_fails_with_its_error_and_is_not_run_again(redis_url, tmp_path):
    """A run that raises is not a restart: the job ends FAILED with the error at once, however it got there."""
    runs = []
    hang = threading.Event()

    def runner(spec, ctx) -> None:
        runs.append(spec.job_id)
        if len(runs) == 1:
            hang.wait(60)  # the trainer dies in the middle of this run
        raise ValueError("rollout 3: the same bad row on every resume")

    first = died(redis_url, runner, max_restarts=3)
    first.submit(parse_spec(spec(tmp_path, "bad-row")))
    wait_job(first, "bad-row", JobState.RUNNING)
    assert first._store.flush()
    registry = died(redis_url, runner, max_restarts=3)
    try:
        job = wait_job(registry, "bad-row", JobState.FAILED)
        assert job.error == "ValueError: rollout 3: the same bad row on every resume" and runs == ["bad-row"] * 2
        assert registry._store.flush()
        assert died(redis_url, runner, max_restarts=3).get("bad-row").state == JobState.FAILED  # stays FAILED
        assert runs == ["bad-row"] * 2
    finally:
        hang.set()
        registry.close()


def test_records_are_written_while_redis_restarts(tmp_path):
    """A Redis restart mid-job fails nothing: the writes wait for it and land once it is back."""
    proc, url = procs.start_redis(tmp_path / "redis")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    go = threading.Event()

    def runner(spec, ctx) -> None:
        assert go.wait(30)
        for rollout_id in range(spec.num_rollout):
            ctx.report(rollout_id, {"rollout/reward_mean": 0.5})

    registry = JobRegistry(runner, RedisJobStore(url))
    try:
        registry.submit(parse_spec(spec(tmp_path, "during-outage")))
        proc.stop()
        go.set()
        deadline = time.monotonic() + 30
        while registry.get("during-outage").state != JobState.SUCCEEDED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc, _ = procs.start_redis(tmp_path / "redis", port=port)
        assert registry._store.flush(60)
        reloaded = JobRegistry(lambda spec, ctx: None, RedisJobStore(url)).get("during-outage")
        assert reloaded.state == JobState.SUCCEEDED and reloaded.rollout_id == 2
        assert [e.seq for e in reloaded.events] == list(range(1, 7))  # queued, running, 3 rollouts, finished
    finally:
        registry.close()
        proc.stop()


def test_a_jobs_own_token_opens_its_record_after_a_restart(redis_url, tmp_path):
    """The job API keeps a job token's digest with the record: after a restart the token still opens its job, and
    still not another."""
    config = TrainerConfig(port=0, rest_port=0, jobs_redis_url=redis_url, api_token="s3cret")
    runner = Runner()
    runner.release.set()
    api = Api(config, runner)
    with JobsRestClient(api.url, token="s3cret") as operator:
        token = operator.submit(spec(tmp_path, "mine"))["job_token"]
        operator.submit(spec(tmp_path, "theirs"))
        wait_state(operator, "theirs", "SUCCEEDED")
    api.stop()
    api = Api(config, runner)
    try:
        with JobsRestClient(api.url, token=token) as client:
            assert client.get("mine")["state"] == "SUCCEEDED"
            with pytest.raises(Unauthenticated):
                client.get("theirs")
    finally:
        api.stop()
