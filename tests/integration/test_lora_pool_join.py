"""Two LoRA jobs on one pool (lora_share_pool) through the rollout manager's pool, lora_sync disk: both sync the same
version, each job's snapshot in a directory of its own; an engine joining later loads the latest adapter of every
job, and each answers on it equal to its job's merged model (float32)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from services.common import procs
from services.rollout.client import EngineState, RolloutClient, adapter_snapshot_root
from services.rollout.config import RolloutManagerConfig
from services.rollout.pool import adapter_join
from services.trainer.weight_sync.adapter_disk import AdapterSync
from services.trainer.weight_sync.weight_sync import (
    AdapterPush,
    WeightBroadcaster,
    sync_engine_pool,
    write_adapter_snapshot,
)
from tests.integration.inprocess import InProcessManager
from tests.integration.lora_adapters import (
    adapter_tensors,
    assert_rows_match,
    generate_rows,
    lora_state,
    merged_model,
    peft_config,
)
from tests.integration.test_weight_sync_pool import wait_pool

RANK = 4
TIMEOUT_S = 60.0
JOBS = {"job-a": 51, "job-b": 52}  # job name -> its adapter's seed


def test_an_engine_joining_a_shared_pool_loads_every_jobs_latest_adapter(tiny_model_dir, tmp_path, shared_router):
    states = {job: lora_state(tiny_model_dir, rank=RANK, seed=seed) for job, seed in JOBS.items()}
    snapshots = tmp_path / "snapshots"
    port = procs.free_port()
    manager = InProcessManager(RolloutManagerConfig(
        port=port, router_url=shared_router.url, model_path=str(tiny_model_dir), num_engines=1,
        engine_join_mode="disk", weight_snapshot_dir=str(snapshots), engine_weight_sync_timeout_s=TIMEOUT_S,
        health_check_interval_s=1.0, health_check_timeout_s=30.0, work_dir=str(tmp_path / "manager")))
    syncs = {job: AdapterSync(WeightBroadcaster([], timeout_s=TIMEOUT_S), lora_sync="disk", timeout_s=TIMEOUT_S)
             for job in JOBS}
    try:
        manager.wait_ready()
        with RolloutClient(f"{procs.HOST}:{port}", timeout_s=TIMEOUT_S) as client:
            for job, state in states.items():  # the same version, as two jobs' first syncs are
                stats = sync_engine_pool(syncs[job], client, adapter_tensors(state), "1",
                                         adapter=AdapterPush(job, peft_config(RANK)))
                assert stats["mode"] == "disk"
            for job in JOBS:  # neither job's snapshot replaced the other's
                directory = adapter_snapshot_root(snapshots, job) / "weight_v1" / "adapters" / f"{job}@v1"
                assert (directory / "adapter_model.safetensors").is_file(), directory
            first = {e.url for e in client.pool_status().engines}
            client.scale(2)
            status = wait_pool(client, lambda s: s.count(EngineState.SERVING) == 2, "the joiner serving")
            (joiner,) = {e.url for e in status.engines} - first
            join = [e for e in status.events if e.kind == "join"][-1]
            assert "weight version 1 (disk)" in join.detail
        with httpx.Client(base_url=joiner, timeout=120.0) as http:
            for job, state in states.items():
                assert_rows_match(generate_rows(http, f"{job}@v1"), [merged_model(tiny_model_dir, state)] * 3)
    finally:
        for sync in syncs.values():
            sync.close()
        manager.stop()


def test_each_jobs_snapshots_are_kept_and_pruned_apart(tmp_path):
    """Job a's newer versions prune only a's (the newest two kept); b's snapshot at a's version stays beside it. A
    job's served name at a version (job@v3) keys the job's root; a name that is no directory name is refused."""
    tensors = [("base_model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(RANK, 8))]
    for version in ("1", "2", "3"):
        write_adapter_snapshot(tensors, tmp_path, version, AdapterPush(f"job-a@v{version}", peft_config(RANK)))
        if version == "1":
            write_adapter_snapshot(tensors, tmp_path, "1", AdapterPush("job-b@v1", peft_config(RANK)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora-job-a", "lora-job-b"]
    assert sorted(p.name for p in adapter_snapshot_root(tmp_path, "job-a").iterdir()) == ["weight_v2", "weight_v3"]
    kept = adapter_snapshot_root(tmp_path, "job-b") / "weight_v1"
    assert adapter_join.snapshot_adapters(str(kept)) == [("job-b@v1", str(kept / "adapters" / "job-b@v1"))]
    assert adapter_snapshot_root(tmp_path, "x@vy") == Path(tmp_path, "lora-x@vy")
    for bad in ("", "..", "a/b", "@v3"):
        with pytest.raises(ValueError, match="cannot name a snapshot directory"):
            adapter_snapshot_root(tmp_path, bad)
