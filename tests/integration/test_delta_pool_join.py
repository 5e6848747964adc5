"""A late joiner through the rollout manager's pool with the pull transport: the trainer (this process) publishes
each version as a full snapshot or a delta (weight_sync_backend disk, update_weight_mode delta) and reports the
store as the pool's snapshot; a new engine catches up from the newest snapshot plus the deltas after it before the
router sends it anything, and holds the trainer's weights bit for bit.
"""

from __future__ import annotations

import httpx
import torch

from services.common import procs, weight_delta
from services.rollout.client import EngineState, RolloutClient
from services.rollout.config import RolloutManagerConfig
from services.trainer.weight_sync.delta_disk import DiskBroadcaster
from services.trainer.weight_sync.weight_sync import sync_engine_pool
from tests.integration.delta_checks import sign_steps
from tests.integration.inprocess import InProcessManager
from tests.integration.test_weight_sync_pool import router_urls, wait_pool

TIMEOUT_S = 30.0


def assert_holds(url: str, weights: dict[str, torch.Tensor], version: str) -> None:
    """The engine (serving float32, as the tiny model's config says) holds `weights` bit for bit."""
    assert httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"] == version
    for name, tensor in weights.items():
        reply = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": tensor.numel()},
                           timeout=30)
        got = torch.tensor(reply.json(), dtype=torch.float32).view(torch.int32)
        assert torch.equal(got, tensor.flatten().view(torch.int32)), f"{url}: {name}"


def test_a_joiner_catches_up_from_the_store_before_it_serves(tiny_model_dir, tmp_path, shared_router):
    steps = sign_steps(tiny_model_dir, 2, lr=1e-6)  # fp32 served: small steps still change few elements' bits
    port = procs.free_port()
    manager = InProcessManager(RolloutManagerConfig(
        port=port, router_url=shared_router.url, model_path=str(tiny_model_dir), num_engines=1,
        engine_join_mode="disk", weight_snapshot_dir=str(tmp_path / "snapshots"),
        engine_weight_sync_timeout_s=TIMEOUT_S, health_check_interval_s=1.0, health_check_timeout_s=10.0,
        work_dir=str(tmp_path / "manager")))
    try:
        manager.wait_ready()
        with RolloutClient(f"{procs.HOST}:{port}", timeout_s=30) as client, \
                DiskBroadcaster([], disk_dir=tmp_path / "weights", timeout_s=TIMEOUT_S,
                                update_weight_mode="delta") as sync:
            assert sync_engine_pool(sync, client, list(steps[0].items()), "0")["mode"] == "full"
            assert sync_engine_pool(sync, client, list(steps[1].items()), "1")["mode"] == "delta"
            assert sync_engine_pool(sync, client, list(steps[2].items()), "2")["mode"] == "delta"
            assert not (tmp_path / "snapshots").exists()  # the store is the joiners' snapshot: no full copy
            assert weight_delta.delta_file(sync.publisher.root, "2").is_file()
            client.scale(2)
            status = wait_pool(client, lambda s: s.count(EngineState.SERVING) == 2, "the joiner serving")
            assert router_urls({"router": shared_router.url}) == {e.url for e in status.engines}
            for engine in status.engines:
                assert_holds(engine.url, steps[2], "2")
            join = [e for e in status.events if e.kind == "join"][-1]
            assert "weight version 2 (disk)" in join.detail
    finally:
        manager.stop()
