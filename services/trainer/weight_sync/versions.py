"""The weight-version bookkeeping of a job: which version the engines hold, its push after training (every rank
gathers, rank 0 pushes), and telling a rollout manager that restarted which version that is.

Version v is the trainer's weights after v rollouts; the engines hold the last version pushed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.settings.rollout import RolloutConfig
from services.common.sglang import lora_adapter_name
from services.rollout.client import ADAPTERS_DIR, RolloutClient, adapter_snapshot_root, snapshot_path
from services.trainer.distributed.parallel import World
from services.trainer.settings.weight_sync import SyncConfig

if TYPE_CHECKING:
    from services.trainer.backends.base import TrainBackend

log = logging.getLogger(__name__)


class EngineWeights:
    """What the engines hold. `engines`: whether this job pushes weights to them (not under debug_rollout_only:
    they keep whatever weights they hold). `push` is collective (every rank calls it); `announce` is rank 0's.

    LoRA jobs sharing the pool (lora_share_pool) pass the same `base_pushed` and `sync_lock`: the base goes to the
    engines once, by the first of them, and their syncs run one after another."""

    def __init__(self, world: World, rollout: RolloutClient | None, *, engines: bool, version: int = 0,
                 sync: SyncConfig | None = None, master_address: str = "127.0.0.1", model_dir: str = "",
                 job_id: str = "", base_pushed: threading.Event | None = None,
                 sync_lock: threading.Lock | None = None, lora: bool = False) -> None:
        self.world, self.rollout, self.engines, self.version = world, rollout, engines, version
        self.lora = lora  # a LoRA job: the engines hold its adapter over their base, versioned apart
        self.unannounceable: set[int] = set()  # versions without a snapshot to announce (warned once each)
        self.broadcaster = None
        self.adapter_broadcaster = None  # a LoRA job's: the adapter goes over the weight-update group
        # a LoRA job's base model went to the engines (at the first push of the job, or of the jobs sharing them)
        self.base_pushed = base_pushed or threading.Event()
        self.sync_lock = sync_lock or threading.Lock()
        self.job_id = job_id
        if engines and sync is not None and world.rank == 0:
            from services.trainer.weight_sync.weight_sync import WeightBroadcaster

            # a few MB: the group (gloo, or nccl to GPU engines) whatever path full weights would take
            backend = sync.weight_sync_backend if sync.weight_sync_backend in ("gloo", "nccl") else "auto"
            from services.trainer.weight_sync.adapter_disk import AdapterSync

            push = WeightBroadcaster([], master_address=master_address, backend=backend,
                                     timeout_s=sync.weight_sync_timeout_s, model_dir=model_dir, job_id=job_id,
                                     group_name=f"lora_update_group_{job_id}")
            self.adapter_broadcaster = AdapterSync(push, lora_sync=sync.lora_sync, disk_dir=sync.update_weight_disk_dir,
                                                   timeout_s=sync.weight_sync_timeout_s)
            from services.trainer.weight_sync.auto import make_broadcaster

            self.broadcaster = make_broadcaster(sync.weight_sync_backend, [], master_address=master_address,
                                                timeout_s=sync.weight_sync_timeout_s,
                                                bucket_bytes=sync.update_weight_buffer_size, model_dir=model_dir,
                                                job_id=job_id, **sync.broadcaster_options())

    def push(self, backend: TrainBackend, version: int) -> dict[str, float]:
        """Every rank: gather the full weights to rank 0 (FSDP), which pushes them to the manager's engines as
        `version`; returns the perf/ metrics on every rank."""
        with self.sync_lock:
            start = time.monotonic()
            if backend.config.lora and not self.base_pushed.is_set():
                # the job's base first, once: the engines may hold another one (another job's trained weights)
                base = list(backend.named_weights(adapters_merged=False))
                self.world.on_rank0(self._push_rank0, base, version, backend.model_path, start)
                self.base_pushed.set()
            if backend.config.lora:  # then the adapter alone: the engines serve it over the base they hold
                config, weights = backend.adapter_weights()
                metrics = self.world.on_rank0(self._push_rank0, weights, version, backend.model_path, start, config)
            else:
                weights = list(backend.named_weights())
                metrics = self.world.on_rank0(self._push_rank0, weights, version, backend.model_path, start)
            self.version = version
            return metrics

    def _push_rank0(self, weights, version: int, model_dir, start: float,
                    adapter_config: dict | None = None) -> dict[str, float]:
        from services.trainer.weight_sync.weight_sync import AdapterPush, sync_engine_pool

        if adapter_config is not None:
            stats = sync_engine_pool(self.adapter_broadcaster, self.rollout, weights, str(version),
                                     adapter=AdapterPush(lora_adapter_name(self.job_id), adapter_config))
        else:
            stats = sync_engine_pool(self.broadcaster, self.rollout, weights, str(version), base_model_dir=model_dir)
        return {"perf/update_weights_seconds": time.monotonic() - start,
                "perf/update_weights_bytes": float(stats.get("bytes", 0)),
                "perf/engine_pause_seconds": float(stats.get("pause_seconds", 0.0))}

    def rollout_config(self, config: RolloutConfig) -> RolloutConfig:
        """Rank 0: `config` as the rollout manager needs it: a LoRA job's lora_sync as resolved at the first sync
        (on the disk route the requests name the adapter's version, versioned_adapter_name)."""
        route = getattr(self.adapter_broadcaster, "route", "auto")
        if route == "auto" or config.args.get("lora_sync") == route:
            return config
        return dataclasses.replace(config, args={**config.args, "lora_sync": route})

    def announce(self) -> None:
        """Rank 0. A rollout manager that restarted knows no weights: its new engines serve the base model, and in
        fully_async every group they generate would be refused as stale while the trainer, waiting for fresh ones,
        never pushes weights again. Tell its pool the version the engines should hold, with the snapshot written at
        that push (weight_v<version> in the pool's snapshot_dir): its engines load it as they do when joining.
        A LoRA job's adapter is synced again from its snapshot instead (`_resync_adapter`)."""
        if not self.engines:
            return
        if self.lora:  # jobs sharing a pool are LoRA jobs: each announces its own adapter, never the pool's version
            self._resync_adapter()
            return
        version = self.version
        pool = self.rollout.pool_status()
        if pool.weight_version == str(version):
            return
        snapshot = self._snapshot(pool.snapshot_dir, version) if pool.snapshot_dir else None
        if snapshot is None:
            if version in self.unannounceable:
                return
            self.unannounceable.add(version)
            log.warning("the rollout manager's pool holds weight version %r, not %d, and there is no snapshot of %d "
                        "(join mode sync?): its engines get the trainer's weights with the next sync",
                        pool.weight_version, version, version)
            return
        self.rollout.begin_weight_sync(str(version))
        self.rollout.end_weight_sync(str(version), success=True, engine_urls=[], snapshot_path=str(snapshot))
        log.warning("the rollout manager's pool held weight version %r, not %d (restarted?): announced %d with its "
                    "snapshot %s", pool.weight_version, version, version, snapshot)

    def _resync_adapter(self) -> None:
        """A LoRA job's announce. A manager that restarted knows no adapter's version (the jobs sharing its pool each
        have their own), so the job's requests would wait for one until the rollout fails. Sync the adapter of the
        last push again, read from its snapshot (lora-<job>/weight_v<version>/ in the pool's snapshot_dir), as any
        sync goes: the engines load it beside the other jobs' adapters, none is demoted, and the pool versions it
        once they hold it. Under the jobs' sync lock, so that no push of this job or another runs meanwhile."""
        name = lora_adapter_name(self.job_id)
        if self.rollout.pool_status().adapter_versions.get(name) == str(self.version):
            return
        with self.sync_lock:
            version = self.version
            pool = self.rollout.pool_status()
            if pool.adapter_versions.get(name) == str(version):
                return
            snapshot = self._adapter_snapshot(pool.snapshot_dir, version) if pool.snapshot_dir else None
            if snapshot is None:
                if version not in self.unannounceable:
                    self.unannounceable.add(version)
                    log.warning("the rollout manager's pool holds no version of adapter %s (restarted?), and there is "
                                "no snapshot of its version %d (join mode sync?): its engines get it with the next "
                                "sync", name, version)
                return
            from safetensors.torch import load_file

            from services.trainer.lora.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
            from services.trainer.weight_sync.weight_sync import WeightSyncError

            config = json.loads((snapshot / ADAPTER_CONFIG).read_text())
            tensors = sorted(load_file(snapshot / ADAPTER_WEIGHTS).items())
            try:
                self._push_rank0(tensors, version, "", time.monotonic(), config)
            except WeightSyncError as err:  # e.g. engines not yet relaunched with LoRA: tried at the next poll
                log.warning("adapter %s: syncing version %d again from %s failed, tried again: %s", name, version,
                            snapshot, err)
                return
        log.warning("the rollout manager's pool held version %r of adapter %s, not %d (restarted?): synced it again "
                    "from its snapshot %s", pool.adapter_versions.get(name, ""), name, version, snapshot)

    def _adapter_snapshot(self, snapshot_dir: str, version: int) -> Path | None:
        """The PEFT directory of this job's adapter at `version` in the pool's `snapshot_dir` (under the name the
        engines served it by, lora_sync's), or None."""
        root = snapshot_path(adapter_snapshot_root(snapshot_dir, lora_adapter_name(self.job_id)), version)
        found = sorted(p for p in (root / ADAPTERS_DIR).glob("*") if p.is_dir()) if (root / ADAPTERS_DIR).is_dir() \
            else []
        return found[0] if len(found) == 1 else None

    def _snapshot(self, snapshot_dir: str, version: int) -> Path | None:
        """The full-weight snapshot of `version` in the pool's `snapshot_dir`, or None."""
        full = snapshot_path(snapshot_dir, version)
        return full if (full / "model.safetensors").is_file() else None

    def close(self) -> None:
        for broadcaster in (self.broadcaster, self.adapter_broadcaster):
            if broadcaster is not None:
                broadcaster.close()
