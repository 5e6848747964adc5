"""Weight syncs through the rollout manager's engine pool with real CPU engines; this test process is the trainer.

Sync join: a new engine waits, unregistered, until the next broadcast rebuilds the weight-update group with it. A peer
SIGKILLed mid-broadcast fails the sync within the broadcaster's timeout, and the next sync, with the engines the pool
names then, succeeds.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import torch

from services.common import procs
from services.rollout.client import EngineState, RolloutClient
from services.rollout.config import RolloutManagerConfig
from services.trainer.weight_sync.weight_sync import WeightBroadcaster, WeightSyncError, sync_engine_pool
from tests.integration.inprocess import InProcessManager

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory, shared_router):
    work = tmp_path_factory.mktemp("weight-sync-pool")
    port = procs.free_port()
    manager = None
    try:
        manager = InProcessManager(RolloutManagerConfig(
            port=port, router_url=shared_router.url, model_path=str(tiny_model_dir),
            num_engines=2, engine_join_mode="sync", engine_weight_sync_timeout_s=TIMEOUT_S,
            health_check_interval_s=1.0, health_check_timeout_s=10.0, work_dir=str(work / "manager")))
        manager.wait_ready()
        with RolloutClient(f"{procs.HOST}:{port}", timeout_s=30) as client, \
                WeightBroadcaster([], timeout_s=TIMEOUT_S, bucket_bytes=64 << 10) as broadcaster:
            yield {"client": client, "broadcaster": broadcaster, "manager": manager,
                   "router": shared_router.url}
    finally:
        if manager is not None:
            manager.stop()


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(tiny_model_dir / "model.safetensors").items())


def perturbed(weights, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, t + 0.01 * torch.randn(t.shape, generator=gen)) for name, t in weights]


def assert_holds(url: str, weights, version: str) -> None:
    assert httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"] == version
    for name, tensor in weights:
        reply = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": tensor.numel()},
                           timeout=30)
        assert torch.equal(torch.tensor(reply.json()), tensor.flatten()), f"{url}: {name}"


def wait_pool(client: RolloutClient, check, what: str, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while not check(status := client.pool_status()):
        assert time.monotonic() < deadline, f"{what}: not true after {timeout_s} s: {status}"
        time.sleep(0.1)
    return status


def router_urls(stack) -> set[str]:
    return {w["url"] for w in httpx.get(f"{stack['router']}/workers", timeout=10).json()["workers"]}


def test_a_new_engine_joins_at_the_next_broadcast(stack, base_weights):
    client, broadcaster = stack["client"], stack["broadcaster"]
    v0 = perturbed(base_weights, 0)
    stats = sync_engine_pool(broadcaster, client, v0, "v0")
    assert stats["attempts"] == 1 and stats["num_engines"] == 2
    status = client.pool_status()
    assert {e.weight_version for e in status.engines} == {"v0"} and status.snapshot_dir == ""  # sync mode
    client.scale(3)
    status = wait_pool(client, lambda s: any(e.state == EngineState.JOINING for e in s.engines), "engine-2 joining")
    (joining,) = [e for e in status.engines if e.state == EngineState.JOINING]
    time.sleep(1.0)
    assert joining.url not in router_urls(stack)  # holds the model's initial weights: no request for it
    group = broadcaster.group
    v1 = perturbed(base_weights, 1)
    stats = sync_engine_pool(broadcaster, client, v1, "v1")
    assert stats["num_engines"] == 3 and broadcaster.group is not group  # rebuilt with the new engine
    status = wait_pool(client, lambda s: s.count(EngineState.SERVING) == 3, "engine-2 serving")
    assert router_urls(stack) == {e.url for e in status.engines}
    for engine in status.engines:
        assert_holds(engine.url, v1, "v1")
    join = [e for e in status.events if e.kind == "join" and e.engine == joining.name][-1]
    assert "version v1 (sync)" in join.detail


class KillAfter(list):
    """Named tensors that SIGKILL an engine once `after` of them were handed to the broadcast (the first pass)."""

    def __init__(self, items, after: int, kill) -> None:
        super().__init__(items)
        self.after, self.kill, self.killed_at = after, kill, None

    def __iter__(self):
        for i, item in enumerate(super().__iter__()):
            if i == self.after and self.killed_at is None:
                self.kill()
                self.killed_at = time.monotonic()
            yield item


def test_a_peer_killed_mid_broadcast_fails_the_sync_in_time_and_the_next_sync_succeeds(stack, base_weights):
    client, broadcaster, pool = stack["client"], stack["broadcaster"], stack["manager"].pool
    status = wait_pool(client, lambda s: s.count(EngineState.SERVING) == 3, "3 engines serving")
    victim = max(status.engines, key=lambda e: e.name)
    proc, _ = pool.launcher.processes[victim.name]
    v2 = KillAfter(perturbed(base_weights, 2), len(base_weights) // 2, lambda: proc.signal(signal.SIGKILL))
    with pytest.raises(WeightSyncError) as failure:
        sync_engine_pool(broadcaster, client, v2, "v2", max_attempts=1)
    elapsed = time.monotonic() - v2.killed_at
    assert v2.killed_at is not None and elapsed < TIMEOUT_S + 2, elapsed  # the broadcaster's timeout, no hang
    assert victim.url in str(failure.value) and failure.value.failed_urls
    v3 = perturbed(base_weights, 3)
    stats = sync_engine_pool(broadcaster, client, v3, "v3")  # the group is rebuilt without the dead peer
    # (a second attempt when the pool had not yet seen the death: the first one fails fast on /health)
    assert stats["attempts"] <= 2 and victim.url not in broadcaster.engine_urls
    status = wait_pool(client, lambda s: s.count(EngineState.SERVING) >= 2 and victim.name not in
                       [e.name for e in s.engines], "the dead engine gone")
    for engine in status.engines:
        if engine.state == EngineState.SERVING:
            assert_holds(engine.url, v3, "v3")
    assert ("fail", victim.name) in [(e.kind, e.engine) for e in status.events]
    assert not procs.cmdline_of(victim.pid)
