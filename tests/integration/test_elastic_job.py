"""A GRPO job on an elastic pool of real CPU engines: it starts with 1 engine, scales to 3 mid-job, one engine is
SIGKILLed (by its recorded PID) while it generates, its replacement joins, the pool scales down to 2 (draining an
engine mid-rollout), and the job finishes with every group of every rollout exactly once, every sample generated with
the rollout's weight version, and every new engine holding the trainer's weights before its first request.

The rollout manager runs in this process (its own event loop in a thread) so the test can look at each engine at the
moment the pool registers it with the router; buffer, reward, router, trainer and engines are processes. The job's
reward function waits for a gate file (elastic_rewards.py), so the test decides when each rollout may end: the pool's
events happen at the points of the job the test names, however fast this machine is.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from services.buffer.client import BufferClient
from services.common import procs
from services.common.errors import NotFound
from services.common.grpc_client import wait_for_health
from services.rollout.client import EngineState, RolloutClient
from services.rollout.config import RolloutManagerConfig
from services.trainer.api.client import JobsRestClient
from tests.integration.inprocess import InProcessManager

NUM_ROLLOUT, BATCH, N_SAMPLES = 6, 4, 2
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def engine_weights(url: str, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        body = {"name": name, "truncate_size": shape.numel()}
        reply = httpx.post(f"{url}/get_weights_by_name", json=body, timeout=30)
        reply.raise_for_status()
        out[name] = torch.tensor(reply.json(), dtype=torch.float32).reshape(shape)
    return out


def capture_joins(manager: InProcessManager, shapes: dict[str, torch.Size], copies: Path) -> list[dict]:
    """Wrap the pool's router registration: just before an engine's first POST /workers (its first chance at a
    request), record the version and weights it holds, a serving engine's weights, and the trainer's snapshot."""
    pool, captured, seen = manager.pool, [], set()
    register = pool.registrations.register

    async def register_and_capture(url: str) -> None:
        if url not in seen and pool.weight_version is not None:
            seen.add(url)
            witness = [e.url for e in pool.records.values() if e.state == EngineState.SERVING
                       and e.weight_version == pool.weight_version and e.url != url]
            copy = copies / f"{len(captured)}"
            shutil.copytree(pool.snapshot_path, copy)
            captured.append({
                "url": url, "version": pool.weight_version, "snapshot": copy,
                "engine_version": httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"],
                "weights": engine_weights(url, shapes),
                "witness": engine_weights(witness[0], shapes) if witness else None})
        await register(url)

    pool.registrations.register = register_and_capture
    return captured


pytestmark = pytest.mark.slow  # the whole stack and three CPU engines: about a minute on 2 cores


@pytest.fixture(scope="module")
def stack(redis_url, tiny_model_dir, tmp_path_factory, shared_router):
    work = tmp_path_factory.mktemp("elastic-job")
    gate = work / "reward-gate"
    gate.write_text("-1")
    started: list[procs.ManagedProcess] = []
    manager = None
    try:
        ports = {name: procs.free_port() for name in ("buffer", "reward", "rollout", "trainer", "rest")}
        for name, args in (("buffer", ["--port", str(ports["buffer"]), "--redis-url", redis_url]),
                           ("reward", ["--port", str(ports["reward"]), "--rest-port", str(procs.free_port())])):
            argv = procs.python_module(f"services.{name}", "--host", procs.HOST, *args)
            env = {"PHYSARUM_TEST_REWARD_GATE": str(gate)}
            started.append(procs.ManagedProcess(name, argv, work / f"{name}.log", env=env).start())
        manager = InProcessManager(RolloutManagerConfig(
            port=ports["rollout"], buffer_addr=f"{procs.HOST}:{ports['buffer']}",
            reward_addr=f"{procs.HOST}:{ports['reward']}", router_url=shared_router.url,
            model_path=str(tiny_model_dir), num_engines=1, engine_per_token_delay_s=0.08,
            health_check_interval_s=1.0, health_check_timeout_s=15.0, drain_timeout_s=10.0,
            request_timeout_s=60.0, work_dir=str(work / "manager"), weight_snapshot_dir=str(work / "snapshots")))
        shapes = {name: t.shape for name, t in load_file(tiny_model_dir / "model.safetensors").items()}
        captured = capture_joins(manager, shapes, work / "captured")
        trainer = procs.ManagedProcess("trainer", procs.python_module(
            "services.trainer", "--host", procs.HOST, "--port", str(ports["trainer"]), "--rest-port",
            str(ports["rest"]), "--buffer-addr", f"{procs.HOST}:{ports['buffer']}", "--rollout-addr",
            f"{procs.HOST}:{ports['rollout']}", "--num-threads", "1"), work / "trainer.log").start()
        started.append(trainer)
        for name in ("buffer", "reward", "rollout", "trainer"):
            wait_for_health(f"{procs.HOST}:{ports[name]}", timeout_s=120)
        yield {"work": work, "gate": gate, "manager": manager, "captured": captured, "model_dir": tiny_model_dir,
               "buffer_addr": f"{procs.HOST}:{ports['buffer']}", "rollout_addr": f"{procs.HOST}:{ports['rollout']}",
               "trainer_url": f"http://{procs.HOST}:{ports['rest']}", "trainer": trainer}
    finally:
        if manager is not None:
            manager.stop()
        for proc in reversed(started):
            proc.stop()


def wait_until(check, timeout_s: float, what: str, job=None):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        if job is not None:
            assert job()["state"] not in TERMINAL, f"{what}: the job ended first: {job()}"
        assert time.monotonic() < deadline, f"{what}: not true after {timeout_s} s"
        time.sleep(0.05)
    return result


def running_requests(url: str) -> int:
    try:
        states = httpx.get(f"{url}/server_info", timeout=5).json()["internal_states"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(s["num_running_reqs"] for s in states)


def test_job_survives_scale_up_a_killed_engine_and_scale_down(stack):
    work, pool = stack["work"], stack["manager"].pool
    num_prompts = NUM_ROLLOUT * BATCH
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i % 10}+{i // 10}=", "label": str(i % 10 + i // 10)}) + "\n"
                            for i in range(num_prompts)))
    spec = {"job_id": "elastic", "hf_checkpoint": str(stack["model_dir"]), "prompt_data": str(data),
            "num_rollout": NUM_ROLLOUT, "rollout_batch_size": BATCH, "n_samples_per_prompt": N_SAMPLES,
            "global_batch_size": BATCH * N_SAMPLES, "rollout_max_response_len": 10, "lr": 1e-4,
            "custom_rm_path": "tests.integration.elastic_rewards.gated_exact_match", "reward_timeout_s": 600.0,
            "weight_sync_timeout_s": 20.0, "lease_timeout_s": 600.0, "rollout_timeout_s": 600.0}

    def allow_rollouts(last: int) -> None:  # rollouts 0..last may end
        stack["gate"].write_text(str((last + 1) * BATCH - 1))

    # status calls get 60 s: the manager runs in this process, and on a loaded machine a replacement's bookkeeping
    # has kept one past the client's default 10 s
    with JobsRestClient(stack["trainer_url"], timeout_s=30) as jobs, \
            RolloutClient(stack["rollout_addr"], timeout_s=60.0) as rollout, \
            BufferClient(stack["buffer_addr"]) as buffer:
        job = jobs.submit(spec)["job_id"]

        def get_job():
            return jobs.get(job)

        def num_groups(rollout_id: int) -> int:
            try:
                return buffer.count_groups(job, rollout_id)
            except NotFound:  # the trainer has not loaded the dataset yet
                return 0

        allow_rollouts(0)
        wait_until(lambda: num_groups(0) == BATCH, 180, "rollout 0 done", get_job)
        rollout.scale(3)  # while rollout 1 runs
        status = wait_until(lambda: (s := rollout.pool_status()).count(EngineState.SERVING) == 3 and s, 180,
                            "3 engines serving", get_job)
        engine_0 = next(e for e in status.engines if e.name == "engine-0")
        victim = max(status.engines, key=lambda e: e.name)
        allow_rollouts(1)  # rollout 2 generates on 3 engines
        wait_until(lambda: num_groups(1) == BATCH, 120, "rollout 1 done", get_job)
        wait_until(lambda: running_requests(victim.url) > 0, 120, f"{victim.name} generating", get_job)
        proc, url = pool.launcher.processes[victim.name]
        assert url == victim.url and proc.pid == victim.pid
        proc.signal(signal.SIGKILL)  # by the PID the launcher recorded, mid-rollout
        replaced = wait_until(lambda: (s := rollout.pool_status()).count(EngineState.SERVING) == 3
                              and victim.name not in [e.name for e in s.engines] and s, 180,
                              f"{victim.name} replaced", get_job)
        newest = max(replaced.engines, key=lambda e: e.name)
        allow_rollouts(2)  # rollout 3 generates on the 2 engines left and the replacement
        wait_until(lambda: num_groups(2) == BATCH, 120, "rollout 2 done", get_job)
        wait_until(lambda: running_requests(newest.url) > 0, 120, f"{newest.name} generating", get_job)
        rollout.scale(2)  # drains the replacement mid-rollout
        # the pool forgets a drained engine before its launcher has stopped the process, and records "stop" after
        final = wait_until(lambda: (s := rollout.pool_status()).count(EngineState.SERVING) == 2 == len(s.engines)
                           and ("stop", newest.name) in [(e.kind, e.engine) for e in s.events] and s, 60,
                           f"2 engines serving, {newest.name} stopped", get_job)
        allow_rollouts(NUM_ROLLOUT)
        wait_until(lambda: get_job()["state"] in TERMINAL, 300, "the job finished")
        result = get_job()
        assert result["state"] == "SUCCEEDED", result["error"]

        groups = {r: buffer.get_batch(job, r, BATCH, timeout_s=10) for r in range(NUM_ROLLOUT)}
    assert [len(groups[r]) for r in range(NUM_ROLLOUT)] == [BATCH] * NUM_ROLLOUT
    all_groups = [g for r in range(NUM_ROLLOUT) for g in groups[r]]
    assert len({g.group_id for g in all_groups}) == num_prompts  # no group twice
    assert sorted(g.prompt_index for g in all_groups) == list(range(num_prompts))
    assert {g.epoch for g in all_groups} == {0}
    for r, batch in groups.items():
        for group in batch:
            assert group.rollout_id == r and len(group.samples) == N_SAMPLES
            for sample in group.samples:  # generated by an engine holding the weights of this rollout, none other
                assert sample.weight_versions == [str(r)], (r, group.group_id, sample.weight_versions)

    events = [(e.kind, e.engine) for e in final.events]
    assert ("fail", victim.name) in events and ("drain", newest.name) in events and ("stop", newest.name) in events
    assert not procs.cmdline_of(victim.pid)
    names = {e.name for e in final.engines}
    assert engine_0.name in names and victim.name not in names and newest.name not in names

    joined = stack["captured"]
    new_urls = {e.url for e in status.engines if e.name != "engine-0"} | {newest.url}
    assert new_urls <= {c["url"] for c in joined}, (new_urls, [c["url"] for c in joined])
    for record in joined:  # at the moment each engine was registered with the router
        assert record["engine_version"] == record["version"], record["url"]
        snapshot = load_file(record["snapshot"] / "model.safetensors")  # the trainer's weights of that version
        for name, tensor in record["weights"].items():
            assert torch.equal(tensor, snapshot[name]), (record["url"], name)
            if record["witness"] is not None:  # and those of an engine that got them by broadcast
                assert torch.equal(tensor, record["witness"][name]), (record["url"], name)
