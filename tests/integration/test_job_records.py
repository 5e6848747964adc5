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
from services.common.errors import InvalidArgument
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
            assert any(f"it resumes from its latest checkpoint (restart {attempt} of at most 2)" in e.message
                       for e in job.events)
            deadline = time.monotonic() + 30
            while job.state != JobState.RUNNING:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert registry._store.flush()
        final = JobRegistry(hangs, RedisJobStore(redis_url), max_restarts=2).get("crashy")
        assert final.state == JobState.FAILED and final.attempts == 3
        assert final.error == "the trainer stopped while the job ran, 3 times (at most 2 restarts): not resumed again"
    finally:
        blocked.set()


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
