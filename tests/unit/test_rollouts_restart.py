"""The manager-restart race of the trainer's rollouts: whatever call the manager dies after, the rollout's groups come
from engines holding the trainer's current weights.

A fake manager counts the trainer's calls and restarts (forgetting its rollouts and its pool's weights) right after the
N-th one, for every N; its groups carry the version its engines held when they generated them, and the fake buffer
refuses stale ones as TakeBatch does, so a trainer that never re-announces the weights would wait forever.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from pathlib import Path

import pytest

from services.common.errors import DeadlineExceeded, Unavailable
from services.common.samples import Sample, SampleGroup, Status
from services.rollout.client import PoolStatus, RolloutState, RolloutStatus, adapter_snapshot_root, snapshot_path
from services.trainer.api.spec import parse_spec
from services.trainer.distributed.parallel import World
from services.trainer.driver import rollouts
from services.trainer.weight_sync.versions import EngineWeights

VERSION = 3  # the trainer's weights: rollout 3 of a fully_async job, every earlier version pushed
MAX_POLLS = 200


class FakeManager:
    """A rollout manager that restarts right after its `restart_after`-th call (0: never)."""

    def __init__(self, snapshot_dir: Path, restart_after: int) -> None:
        self.snapshot_dir, self.restart_after = snapshot_dir, restart_after
        self.calls, self.weight_version, self.running = 0, str(VERSION), False
        self.generated_with: str | None = None  # the pool's version while the stream generated

    def _step(self) -> None:
        self.calls += 1
        if self.calls == self.restart_after:
            self.weight_version, self.running = "", False  # a fresh process: base weights, no rollouts

    def pool_status(self) -> PoolStatus:
        reply = PoolStatus(desired_replicas=2, weight_version=self.weight_version, snapshot_dir=str(self.snapshot_dir))
        self._step()  # each call is answered, then the manager may die
        return reply

    def begin_weight_sync(self, version: str) -> None:
        self._step()

    def end_weight_sync(self, version: str, *, success: bool, engine_urls: list[str], snapshot_path: str) -> None:
        assert success and Path(snapshot_path).name.endswith(version)
        self.weight_version = version
        self._step()

    def start_rollout(self, config, rollout_id: int, weight_version: str) -> bool:
        self.running = True
        self._step()
        return False

    def rollout_status(self, job_id: str, rollout_id: int) -> RolloutStatus:
        reply = RolloutStatus(state=RolloutState.RUNNING if self.running else RolloutState.UNKNOWN)
        self._step()
        return reply


class FakeBuffer:
    """TakeBatch: fresh groups exist only once the stream runs on engines at the trainer's version."""

    def __init__(self, manager: FakeManager) -> None:
        self.manager, self.polls, self.fresh_polls = manager, 0, 0

    def take_batch(self, job_id: str, rollout_id: int, num_groups: int, **kwargs) -> types.SimpleNamespace:
        self.polls += 1
        assert self.polls < MAX_POLLS, "the trainer keeps waiting for fresh groups: the engines never got the weights"
        fresh = self.manager.running and self.manager.weight_version == str(rollout_id)
        self.fresh_polls = self.fresh_polls + 1 if fresh else 0
        if self.fresh_polls < 3:  # generating takes a few polls, during which the manager may die too
            raise DeadlineExceeded("no fresh groups yet")
        sample = Sample(tokens=[1, 2], response_length=1, status=Status.COMPLETED,
                        weight_versions=[self.manager.weight_version])
        groups = [SampleGroup(group_id=f"{job_id}:0:{i}", job_id=job_id, rollout_id=rollout_id, prompt_index=i,
                              epoch=0, samples=[sample]) for i in range(num_groups)]
        return types.SimpleNamespace(groups=groups, num_stale_dropped=0, num_stale_regenerated=0)


def take_rollout(tmp_path: Path, restart_after: int) -> tuple[list[Sample], FakeManager]:
    snapshot = snapshot_path(tmp_path, VERSION)
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "model.safetensors").write_bytes(b"")
    spec = parse_spec({"job_id": "race", "hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 5,
                       "rollout_batch_size": 2, "mode": "fully_async"})
    manager = FakeManager(tmp_path, restart_after)
    deps = types.SimpleNamespace(rollout=manager, buffer=FakeBuffer(manager), world=World())
    ctx = types.SimpleNamespace(check_cancelled=lambda: None)
    weights = EngineWeights(World(), manager, engines=True, version=VERSION)
    job = rollouts.Rollouts(spec.driver, spec.rollout, deps, ctx, weights)
    return job.samples(VERSION, functools.partial(job.take, VERSION)), manager


@pytest.mark.parametrize("restart_after", range(0, 8))  # 7 calls in all without a restart
def test_a_manager_restarted_after_any_call_gets_the_weights_before_its_groups_count(tmp_path, restart_after):
    samples, manager = take_rollout(tmp_path, restart_after)
    assert len(samples) == 2 and all(s.weight_versions == [str(VERSION)] for s in samples)
    assert manager.weight_version == str(VERSION)
    if restart_after:
        assert manager.calls >= restart_after  # the restart did happen inside the trainer's calls


def test_an_unavailable_manager_is_waited_for(tmp_path, monkeypatch):
    """The restart window itself: status calls fail UNAVAILABLE a few times, then the new manager answers."""
    failures = iter([True, True, False])
    original = FakeManager.rollout_status

    def flaky(self, job_id, rollout_id):
        if next(failures, False):
            raise Unavailable("rollout manager: connection refused")
        return original(self, job_id, rollout_id)

    monkeypatch.setattr(FakeManager, "rollout_status", flaky)
    samples, _ = take_rollout(tmp_path, restart_after=4)
    assert all(s.weight_versions == [str(VERSION)] for s in samples)


def test_a_manager_unavailable_at_the_start_is_waited_for(tmp_path, monkeypatch):
    """A manager restarting before the rollout starts (its pool still starting) answers StartRollout UNAVAILABLE a
    few times: the trainer retries instead of failing the job."""
    failures = iter([True, True, False])
    original = FakeManager.start_rollout

    def starting(self, config, rollout_id, weight_version):
        if next(failures, False):
            raise Unavailable("rollout manager: the engine pool is still starting; wait for health SERVING")
        return original(self, config, rollout_id, weight_version)

    monkeypatch.setattr(FakeManager, "start_rollout", starting)
    monkeypatch.setattr(rollouts, "START_RETRY_S", 0.0)
    samples, _ = take_rollout(tmp_path, restart_after=0)
    assert len(samples) == 2 and all(s.weight_versions == [str(VERSION)] for s in samples)


def test_a_full_weight_job_announces_the_snapshot_of_its_version(tmp_path):
    """A restarted manager's pool holds another version (or none): the job announces the full-weight snapshot of its
    own version, so that the pool's engines load it."""
    snapshot = snapshot_path(tmp_path, VERSION)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"")
    manager = FakeManager(tmp_path, restart_after=0)
    manager.weight_version = "5"  # the pool's version before the manager restarted
    EngineWeights(World(), manager, engines=True, version=VERSION).announce()
    assert manager.weight_version == str(VERSION) and manager.calls == 3  # the status, begin and end calls


def test_a_lora_jobs_adapter_snapshot_is_in_its_own_root(tmp_path):
    """A LoRA job's snapshots live in lora-<job>/ of the pool's snapshot directory; a full-weight snapshot of the same
    version at the top (another job's, earlier on the pool) is not this job's to sync again."""
    full = snapshot_path(tmp_path, VERSION)
    full.mkdir(parents=True)
    (full / "model.safetensors").write_bytes(b"")
    weights = EngineWeights(World(), FakeManager(tmp_path, restart_after=0), engines=True, version=VERSION,
                            job_id="race", lora=True)
    assert weights._adapter_snapshot(str(tmp_path), VERSION) is None
    own = snapshot_path(adapter_snapshot_root(tmp_path, "race"), VERSION) / "adapters" / f"race@v{VERSION}"
    own.mkdir(parents=True)
    assert weights._adapter_snapshot(str(tmp_path), VERSION) == own


class AdapterManager(FakeManager):
    """A manager whose pool reports each adapter's version (a LoRA job's announce reads it)."""

    def __init__(self, snapshot_dir: Path, adapter_versions: dict[str, str]) -> None:
        super().__init__(snapshot_dir, restart_after=0)
        self.adapter_versions = adapter_versions

    def pool_status(self) -> PoolStatus:
        return dataclasses.replace(super().pool_status(), adapter_versions=dict(self.adapter_versions))


def test_a_lora_job_whose_adapter_version_the_pool_knows_syncs_nothing(tmp_path):
    manager = AdapterManager(tmp_path, {"race": str(VERSION), "other": "9"})
    EngineWeights(World(), manager, engines=True, version=VERSION, job_id="race", lora=True).announce()
    assert manager.calls == 1  # the status, no sync


def test_a_lora_job_with_no_snapshot_of_its_adapter_leaves_the_pool_as_it_is(tmp_path, caplog):
    """A restarted manager (no adapter known) and no snapshot to sync from (join mode sync): nothing is synced, the
    pool's version stays the other job's, and the warning comes once."""
    manager = AdapterManager(tmp_path, {"other": "9"})
    manager.weight_version = "9"
    weights = EngineWeights(World(), manager, engines=True, version=VERSION, job_id="race", lora=True)
    for _ in range(2):
        weights.announce()
    assert manager.weight_version == "9" and manager.calls == 4  # two status calls each time, no begin or end
    assert sum("no snapshot of its version" in r.message for r in caplog.records) == 1
