"""The engine pool inside the rollout manager process, with the real sglang-router and fake-compute engines (cheap,
no torch): scale through gRPC, REST and `physarum scale`; drain a leaving engine; replace a killed and a hung one so
that the replacement joins with the current weight version; Prometheus metrics.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common import procs
from services.common.grpc_client import wait_for_health
from services.rollout.client import EngineState, PoolStatus, RolloutClient

DELAY_S = 0.02
INTERVAL_S, TIMEOUT_S = 0.5, 2.0


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory, shared_router):
    """The session's router + a manager (1 fake engine to start with); stopped by PID at the end."""
    work = tmp_path_factory.mktemp("engine-pool")
    port, rest_port = procs.free_port(), procs.free_port()
    argv = procs.python_module(
        "services.rollout", "--host", procs.HOST, "--port", str(port), "--rest-port", str(rest_port),
        "--router-url", shared_router.url, "--model-path", str(tiny_model_dir),
        "--num-engines", "1", "--engine-fake-compute", "true", "--engine-per-token-delay-s", str(DELAY_S),
        "--health-check-interval-s", str(INTERVAL_S), "--health-check-timeout-s", str(TIMEOUT_S),
        "--drain-timeout-s", "5", "--work-dir", str(work / "manager"), "--weight-snapshot-dir", str(work / "snap"),
        "--grace-s", "2")
    manager = procs.ManagedProcess("manager", argv, work / "manager.log").start()
    try:
        wait_for_health(f"{procs.HOST}:{port}", timeout_s=60)
        with RolloutClient(f"{procs.HOST}:{port}") as client:
            yield {"client": client, "router": shared_router, "rest": f"http://{procs.HOST}:{rest_port}", "work": work,
                   "addr": f"{procs.HOST}:{port}", "manager": manager}
    finally:
        code = manager.stop(grace_s=40)
    assert code == 0, manager.log_tail()


def wait_status(client: RolloutClient, check, what: str, timeout_s: float = 30.0) -> PoolStatus:
    deadline = time.monotonic() + timeout_s
    while not check(status := client.pool_status()):
        assert time.monotonic() < deadline, f"{what}: not true after {timeout_s} s; pool: {status}"
        time.sleep(0.1)
    return status


def serving_exactly(n: int):
    return lambda s: s.count(EngineState.SERVING) == n == len(s.engines)


def router_urls(stack) -> list[str]:
    return sorted(w["url"] for w in stack["router"].list_workers())


def test_scale_through_grpc_rest_and_cli(stack):
    client = stack["client"]
    status = wait_status(client, serving_exactly(1), "1 engine serving")
    assert status.desired_replicas == 1 and status.join_mode == "disk" and status.rest_url == stack["rest"]
    assert client.scale(3).desired_replicas == 3
    status = wait_status(client, serving_exactly(3), "3 engines serving")
    assert router_urls(stack) == sorted(e.url for e in status.engines)
    assert all(e.pid > 0 and procs.cmdline_of(e.pid) for e in status.engines)
    reply = httpx.post(f"{stack['rest']}/v1/scale", json={"replicas": 2}, timeout=10)
    assert reply.status_code == 200 and reply.json()["desired_replicas"] == 2
    status = wait_status(client, serving_exactly(2), "2 engines serving")
    assert router_urls(stack) == sorted(e.url for e in status.engines)
    assert [e["state"] for e in httpx.get(f"{stack['rest']}/v1/engines", timeout=10).json()["engines"]] == [
        "SERVING", "SERVING"]
    assert httpx.post(f"{stack['rest']}/v1/scale", json={"replicas": -1}, timeout=10).status_code == 422
    cli = subprocess.run([sys.executable, "-m", "physarum", "scale", "--replicas", "1", "--addr", stack["addr"]],
                         capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert cli.returncode == 0 and "1 engines wanted" in cli.stdout, cli.stderr
    # the pool forgets a drained engine before its launcher has stopped the process, and records "stop" after
    status = wait_status(client, lambda s: serving_exactly(1)(s) and [e.kind for e in s.events].count("stop") == 2,
                         "1 engine serving, 2 stopped")
    engines, _ = client.list_engines()
    assert [e.url for e in engines] == [status.engines[0].url] == router_urls(stack)
    kinds = [e.kind for e in status.events]
    assert kinds.count("launch") == 3 and kinds.count("drain") == 2 and kinds.count("stop") == 2


def generate(router_url: str, rid: str) -> dict:
    body = {"input_ids": [5, 6, 7], "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    reply = httpx.post(f"{router_url}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def running_requests(url: str) -> int:
    states = httpx.get(f"{url}/server_info", timeout=5).json()["internal_states"]
    return sum(s["num_running_reqs"] for s in states)


def test_a_leaving_engine_is_drained_its_requests_aborted_not_lost(stack):
    client = stack["client"]
    client.scale(2)
    status = wait_status(client, serving_exactly(2), "2 engines serving")
    victim = max(status.engines, key=lambda e: int(e.name.split("-")[1]))  # the newest leaves first
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(generate, stack["router"].url, f"drain-{i}") for i in range(6)]
        deadline = time.monotonic() + 20
        while not all(running_requests(e.url) for e in status.engines):
            assert time.monotonic() < deadline, "requests never ran on both engines"
            time.sleep(0.05)
        start = time.monotonic()
        client.scale(1)
        replies = [f.result(timeout=30) for f in futures]
    finished = sorted(r["meta_info"]["finish_reason"]["type"] for r in replies)
    aborted = [r for r in replies if r["meta_info"]["finish_reason"]["type"] == "abort"]
    assert len(replies) == 6 and "abort" in finished and "length" in finished, finished
    assert all(len(r["output_ids"]) == 100 for r in replies if r not in aborted)
    assert all(len(r["output_ids"]) < 100 for r in aborted)  # cut short, to be retried by the manager
    status = wait_status(client, serving_exactly(1), "1 engine serving")
    assert time.monotonic() - start < 10 and victim.url not in [e.url for e in status.engines]
    assert router_urls(stack) == [status.engines[0].url]
    deadline = time.monotonic() + 15
    while procs.cmdline_of(victim.pid):  # stopped by the PID the launcher recorded
        assert time.monotonic() < deadline, f"{victim.name} (pid {victim.pid}) still running"
        time.sleep(0.1)


def publish_version(stack, version: str) -> str:
    """What the trainer does in disk-join mode: a snapshot, then Begin/End around its broadcast."""
    import torch

    from services.trainer.weight_sync.weight_sync import write_snapshot

    client = stack["client"]
    plan = client.begin_weight_sync(version)
    assert plan.snapshot_dir == str(stack["work"] / "snap")
    path = write_snapshot([("model.norm.weight", torch.ones(4))], plan.snapshot_dir, version)
    for url in plan.engine_urls:  # fake engines hold no weights: the broadcast only sets the version
        httpx.post(f"{url}/update_weight_version", json={"new_version": version}, timeout=10).raise_for_status()
    client.end_weight_sync(version, success=True, engine_urls=plan.engine_urls, snapshot_path=path, seconds=0.1,
                           num_bytes=16)
    return path


def test_a_killed_engine_is_replaced_and_joins_with_the_current_weights(stack):
    client = stack["client"]
    client.scale(2)
    wait_status(client, serving_exactly(2), "2 engines serving")
    publish_version(stack, "v1")
    status = wait_status(client, lambda s: {e.weight_version for e in s.engines} == {"v1"}, "engines at v1")
    dead, before = status.engines[0], {e.name for e in status.engines}
    os.kill(dead.pid, signal.SIGKILL)  # the PID the launcher recorded
    status = wait_status(client, lambda s: dead.url not in [e.url for e in s.engines] and serving_exactly(2)(s),
                         "the killed engine replaced")
    assert dead.url not in router_urls(stack) and router_urls(stack) == sorted(e.url for e in status.engines)
    (new,) = [e for e in status.engines if e.name not in before]
    for engine in status.engines:
        assert httpx.get(f"{engine.url}/model_info", timeout=5).json()["weight_version"] == "v1"
    events = [(e.kind, e.engine) for e in status.events]
    assert ("fail", dead.name) in events and ("join", new.name) in events
    join = [e for e in status.events if e.kind == "join" and e.engine == new.name][-1]
    assert "version v1 (disk)" in join.detail
    metrics = httpx.get(f"{stack['rest']}/metrics", timeout=10).text
    assert 'physarum_rollout_scale_events_total{kind="fail"} 1.0' in metrics
    assert 'physarum_rollout_engine_join_seconds_count{mode="disk"} 1.0' in metrics
    assert 'physarum_rollout_weight_syncs_total{result="ok"} 1.0' in metrics
    assert "physarum_rollout_weight_sync_bytes_total 16.0" in metrics
    assert 'physarum_rollout_engines{state="serving"} 2.0' in metrics
    assert "physarum_rollout_engines_desired 2.0" in metrics
    assert "physarum_gateway_sessions_open 0.0" in metrics  # the agent gateway's, on the same page
    for engine in status.engines:
        assert f'physarum_rollout_engine_healthy{{engine="{engine.name}"}} 1.0' in metrics
        assert f'physarum_rollout_engine_load{{engine="{engine.name}"}}' in metrics


def test_a_hung_engine_fails_its_health_check_and_is_replaced(stack):
    client = stack["client"]
    status = wait_status(client, serving_exactly(2), "2 engines serving")
    hung = status.engines[-1]
    start = time.monotonic()
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        wait_status(client, lambda s: hung.url not in [e.url for e in s.engines], "the hung engine removed")
        elapsed = time.monotonic() - start
        assert hung.url not in router_urls(stack)
    finally:
        if procs.cmdline_of(hung.pid):
            os.kill(hung.pid, signal.SIGCONT)  # let its SIGTERM through
    assert elapsed < INTERVAL_S + TIMEOUT_S + 3
    status = wait_status(client, serving_exactly(2), "replacement serving")
    assert {e.weight_version for e in status.engines} == {"v1"}
    detail = [e.detail for e in status.events if e.kind == "fail" and e.engine == hung.name][-1]
    assert f"no /health_generate reply in {TIMEOUT_S} s" in detail


def test_an_engine_killed_again_and_again_is_replaced_each_time_without_a_growing_wait(stack):
    """Kill the newest engine as soon as it serves, four times (real processes, by the PIDs the pool reports): each
    replacement serves the current version, and the pool's own record of each replacement says it waited 0 s with
    no start failure counted (engines killed after they showed that they start are no crash loop)."""
    client = stack["client"]
    status = wait_status(client, serving_exactly(2), "2 engines serving")
    killed = []
    for _ in range(4):
        victim = max(status.engines, key=lambda e: int(e.name.split("-")[1]))
        os.kill(victim.pid, signal.SIGKILL)
        killed.append(victim.name)
        status = wait_status(client, lambda s, gone=victim.url: gone not in [e.url for e in s.engines]
                             and serving_exactly(2)(s), f"{victim.name} replaced", timeout_s=60)
        assert {e.weight_version for e in status.engines} == {"v1"}
    replaced = {e.engine: e.detail for e in status.events if e.kind == "replace"}
    assert [replaced[name] for name in killed] == ["in 0.00 s (0 start failures in a row)"] * 4
