"""Durability: a process of the stack SIGKILLed in the middle of an asynchronous job — the trainer, the
rollout manager, the buffer, Redis — and started again; the job still succeeds, each rollout trained exactly the
groups the buffer assigned it (its debug dump against Redis), and Redis shows no prompt lost and none trained twice.

The module runs its own stack (it kills its processes), started once; each test starts what it killed again with the
recorded command line (physarum.stack.restart / restart_trainer), so that `down` stops the new process too.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest
import torch

from physarum import stack
from services.common import procs
from services.rollout.client import EngineState, RolloutClient
from services.rollout.pool.router import RouterClient
from services.trainer.api.client import TERMINAL_STATES
from tests.e2e import durability as d
from tests.e2e.roots import stack_roots
from tests.e2e.test_loop import job_spec

NUM_PROMPTS, BATCH, SAMPLES, NUM_ROLLOUT = 8, 4, 2, 6  # 6 rollouts of 4 groups: 3 epochs of 8 prompts
JOB_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def durable_stack(session_dir, tiny_model_dir):
    work_dir = session_dir / "durable-stack"
    # appendfsync always (the default of the chart and `physarum up`): Redis appends each write to its AOF and fsyncs
    # it before it answers, so whatever the buffer was told is stored survives the kill. everysec fsyncs once a
    # second: a crash can lose up to the last second of acknowledged writes (two, when a slow disk makes Redis
    # postpone the write), e.g. a TakeBatch assignment, which puts groups the trainer already trained back in the
    # stream, to be trained twice.
    # The per-token delay makes a rollout take about a second, long enough to kill something in the middle of one.
    stack.up(stack.StackOptions(work_dir=work_dir, model_path=tiny_model_dir, num_engines=2, trainer_threads=1,
                                redis_appendfsync="always", engine_per_token_delay_s=0.05,
                                path_roots=stack_roots(session_dir)))
    yield work_dir
    stack.down(work_dir)


@pytest.fixture(scope="module")
def prompts(session_dir) -> Path:
    return d.write_prompts(session_dir / "durability" / "prompts.jsonl", [(a, a + 1) for a in range(NUM_PROMPTS)])


def spec(tiny_model_dir, prompts, job_id: str, dumps: Path, **overrides) -> dict:
    # lease_timeout_s 5: the leases of a killed manager come back soon
    return job_spec(tiny_model_dir, prompts, job_id=job_id, num_rollout=NUM_ROLLOUT, rollout_batch_size=BATCH,
                    n_samples_per_prompt=SAMPLES, global_batch_size=SAMPLES * BATCH, rollout_max_response_len=4,
                    lease_timeout_s=5.0, rollout_timeout_s=120.0,
                    save_debug_rollout_data=str(dumps / "rollout_{rollout_id}.pt"), **overrides)


def load_dump(dumps: Path, rollout_id: int) -> list[dict] | None:
    """Rollout `rollout_id`'s samples as the trainer dumped them; None while there is no (complete) dump."""
    try:
        return torch.load(dumps / f"rollout_{rollout_id}.pt", weights_only=True)["samples"]
    except (OSError, RuntimeError, EOFError):
        return None


def check_job(work_dir: Path, job_id: str, dumps: Path) -> d.Ledger:
    """Each rollout trained the groups Redis assigned it, and no prompt was lost or trained twice."""
    book = d.ledger(stack.read_state(work_dir)["redis_url"], job_id, NUM_ROLLOUT, BATCH)
    d.check_ledger(book, NUM_ROLLOUT, BATCH)
    for rollout_id, slots in book.trained.items():
        samples = load_dump(dumps, rollout_id)
        trained = collections.Counter(s["group_index"] for s in samples)
        assigned = collections.Counter(int(slot.split(":")[1]) for slot in slots)
        assert trained == {i: SAMPLES * n for i, n in assigned.items()}, f"rollout {rollout_id} trained {trained}, " \
                                                                         f"Redis assigned it {slots}"
    per_epoch = book.trained_per_epoch()
    assert sum(per_epoch.values()) == NUM_ROLLOUT * BATCH and book.epoch >= 2, f"{per_epoch}, {book}"
    return book


def wait_rollout(state: dict, job_id: str, rollout_id: int) -> None:
    """Until the job has reported rollout `rollout_id`; it must still run (the kill comes in the middle of it)."""
    def reached() -> dict | None:
        job = d.job(state, job_id)
        return job if job["rollout_id"] >= rollout_id or job["state"] in TERMINAL_STATES else None

    job = d.wait_for(f"job {job_id} reports rollout {rollout_id}", reached, JOB_TIMEOUT_S)
    assert job["state"] == "RUNNING", f"job {job_id} ended before the kill: {job}"


def test_trainer_killed_resumes_from_its_checkpoint(durable_stack, tiny_model_dir, prompts, tmp_path):
    """fully_async with a deep stream (stale groups regenerated): SIGKILL the trainer after it took a rollout and
    before it checkpointed it; a new trainer on the same ports resumes the job by itself (its record in Redis, `load`
    from its own `save`) and trains that rollout again on exactly the same groups."""
    state = stack.read_state(durable_stack)
    job_id, save, dumps = "durable-trainer", tmp_path / "ckpt", tmp_path / "dumps"
    job = spec(tiny_model_dir, prompts, job_id, dumps, mode="fully_async", max_inflight_groups=3 * BATCH,
               save=str(save), save_interval=1)
    d.submit(state, job)
    latest = save / "latest_checkpointed_iteration.txt"

    def taken_not_checkpointed() -> int | None:
        """A rollout after the second checkpoint whose samples the trainer has (dumped) and has not checkpointed."""
        done = int(latest.read_text() or -1) if latest.is_file() else -1
        return done + 1 if done >= 1 and load_dump(dumps, done + 1) is not None else None

    taken = d.wait_for("a rollout taken after the second checkpoint", taken_not_checkpointed, JOB_TIMEOUT_S,
                       interval_s=0.02)
    d.kill(durable_stack, "trainer")
    assert int(latest.read_text()) == taken - 1 < NUM_ROLLOUT - 1, f"rollout {taken} was checkpointed before the kill"
    before = load_dump(dumps, taken)

    state = stack.restart_trainer(durable_stack)  # the job resumes by itself: its record is in Redis
    final, events = d.wait_job(state, job_id, JOB_TIMEOUT_S)

    assert final["state"] == "SUCCEEDED", final["error"]
    assert final["attempts"] == 1
    restarted = next(i for i, e in enumerate(events) if "(restart 1; " in e["message"])
    events = events[restarted:]  # the resumed run's
    assert any(f"at rollout {taken}" in e["message"] for e in events), [e["message"] for e in events]
    assert d.trained_rollouts(events) == list(range(taken, NUM_ROLLOUT))
    # The job's total (kept in Redis across the restart): the deep stream had stale groups, regenerated.
    assert max(e["metrics"].get("buffer/stale_regenerated", 0.0) for e in events) > 0
    again = load_dump(dumps, taken)
    assert [(s["group_index"], s["index"], s["tokens"]) for s in again] == \
           [(s["group_index"], s["index"], s["tokens"]) for s in before], f"rollout {taken} changed on resume"
    check_job(durable_stack, job_id, dumps)


def router_urls(state: dict) -> set[str]:
    with RouterClient(state["router_url"], timeout_s=10.0) as router:
        return {w["url"].rstrip("/") for w in router.list_workers()}


def test_rollout_manager_killed_restarts_and_the_job_goes_on(durable_stack, tiny_model_dir, prompts, tmp_path):
    """fully_async: SIGKILL the manager mid-job and start it again on its port; the new manager stops the engines the
    dead one left running and removes them from the router before it starts its own; the trainer re-starts its
    stream when the new manager reports it UNKNOWN and announces its weights to the new pool (the snapshot of its
    last push), the dead manager's leases expire (lease_timeout_s 5)."""
    state = stack.read_state(durable_stack)
    job_id, dumps = "durable-manager", tmp_path / "dumps"
    with RolloutClient(state["rollout_addr"]) as rollout:
        engines = [(e.pid, procs.start_time(e.pid), e.url) for e in rollout.pool_status().engines]
    assert len(engines) == 2 and all(started is not None for _, started, _ in engines), engines
    d.submit(state, spec(tiny_model_dir, prompts, job_id, dumps, mode="fully_async"))
    wait_rollout(state, job_id, 1)
    d.kill(durable_stack, "rollout")
    # Each engine runs in its own session: it outlives the killed manager, still registered with the router.
    assert all(procs.start_time(pid) == started for pid, started, _ in engines), "engines died with the manager"
    stack.restart(durable_stack, "rollout")  # returns once the new pool serves
    # The new manager found them in its launcher's engines.json: stopped, and no longer listed by the router, so
    # that no request reaches an engine that never takes the trainer's weights again.
    assert [url for pid, started, url in engines if procs.start_time(pid) == started] == []
    with RolloutClient(state["rollout_addr"]) as rollout:
        new = {e.url for e in rollout.pool_status().engines}  # a new engine may have got an old one's port
    stale = {url for _, _, url in engines} & (router_urls(state) - new)
    assert not stale, f"the router still lists the dead manager's engines {stale}"
    final, events = d.wait_job(state, job_id, JOB_TIMEOUT_S)

    assert final["state"] == "SUCCEEDED", final["error"]
    assert d.trained_rollouts(events) == list(range(NUM_ROLLOUT))
    check_job(durable_stack, job_id, dumps)
    with RolloutClient(state["rollout_addr"]) as rollout:
        pool = rollout.pool_status()
    # The new manager's engines took every push after the restart: they end with the trainer's last weights.
    assert pool.weight_version == str(NUM_ROLLOUT)
    assert {(e.state, e.weight_version) for e in pool.engines} == {(EngineState.SERVING, str(NUM_ROLLOUT))}
    assert router_urls(state) == {e.url for e in pool.engines}  # the router sends requests to these only


def outage_mid_job(work_dir: Path, name: str, job_id: str, dumps: Path, down_s: float = 2.0) -> d.Ledger:
    """Once the job reported rollout 1, SIGKILL `name`, start it again down_s later; the job must go on to the end
    without being resubmitted, and the buffer's ledger must balance."""
    state = stack.read_state(work_dir)
    wait_rollout(state, job_id, 1)
    d.kill(work_dir, name)
    time.sleep(down_s)
    stack.restart(work_dir, name)
    final, events = d.wait_job(state, job_id, JOB_TIMEOUT_S)
    assert final["state"] == "SUCCEEDED", final["error"]
    assert d.trained_rollouts(events) == list(range(NUM_ROLLOUT))
    return check_job(work_dir, job_id, dumps)


def test_buffer_killed_restarts_and_the_job_goes_on(durable_stack, tiny_model_dir, prompts, tmp_path):
    """one_step_async: SIGKILL the buffer service mid-job, start it again on its port two seconds later; its
    clients (trainer and manager) retry until it answers again."""
    state = stack.read_state(durable_stack)
    job_id, dumps = "durable-buffer", tmp_path / "dumps"
    d.submit(state, spec(tiny_model_dir, prompts, job_id, dumps, mode="one_step_async"))
    book = outage_mid_job(durable_stack, "buffer", job_id, dumps)
    # No stream: a slot served and not trained can only be back in the buffer, to be leased again (a lease whose
    # reply died with the buffer expires).
    untrained = {where[0] for where in book.places.values() if not where[0].startswith("trained")}
    assert untrained <= {"returned", "leased"}, book.places


def test_redis_killed_restarts_from_its_aof_and_the_job_goes_on(durable_stack, tiny_model_dir, prompts, tmp_path):
    """fully_async, stale groups dropped: SIGKILL redis-server mid-job, start it again two seconds later with its
    command line (same port, same directory: it replays its AOF); the buffer reconnects, nothing acknowledged is
    lost."""
    state = stack.read_state(durable_stack)
    job_id, dumps = "durable-redis", tmp_path / "dumps"
    d.submit(state, spec(tiny_model_dir, prompts, job_id, dumps, mode="fully_async", max_inflight_groups=2 * BATCH,
                         stale_policy="drop"))
    outage_mid_job(durable_stack, "redis", job_id, dumps)
