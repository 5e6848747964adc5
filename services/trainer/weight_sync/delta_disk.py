"""weight_sync_backend disk, slime's disk transport: each version is published under a directory the trainer and the
engines share (a volume), and every engine pulls it (/pull_weights) through `services.common.weight_delta`'s layout.

update_weight_mode full publishes a full snapshot per version; delta publishes a delta from the previous version,
and a full snapshot whenever the deltas since the last one add up to a model's size (so an engine that joins late
reads at most about two models' worth). Each engine walks from the version it holds; one that cannot (a checksum
failure, a delta gone) is answered with a full snapshot of the version, published then, and pulls again.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from services.common import weight_delta
from services.common.errors import PhysarumError
from services.common.sglang import SGLangClient
from services.trainer.checkpoint import safetensors_io
from services.trainer.checkpoint.hf_files import copy_side_files
from services.trainer.settings.weight_sync import DeltaSettings
from services.trainer.weight_sync import wire
from services.trainer.weight_sync.delta import DeltaTracker
from services.trainer.weight_sync.weight_sync import WeightBroadcaster, WeightSyncError, _on_all

log = logging.getLogger(__name__)


def _replace(staging: Path, final: Path) -> None:
    """Move a fully written file or directory into place (readers never see a partial one)."""
    if final.is_dir():
        shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)


class Publisher:
    """The trainer's side of the shared directory: full snapshots and deltas, and their clean-up."""

    def __init__(self, root: str | Path, *, mode: str = "delta", delta: DeltaSettings | None = None,
                 base_model_dir: str | Path | None = None) -> None:
        if mode not in ("full", "delta"):
            raise ValueError(f"update_weight_mode must be full or delta, got {mode!r}")
        self.root = Path(root)
        self.mode = mode
        self.base_model_dir = base_model_dir
        self.tracker = DeltaTracker(delta)
        self.chain_bytes = 0  # of the deltas published since the newest full snapshot
        self.started = False

    def publish(self, copies: list[tuple[str, torch.Tensor]], version: str) -> dict:
        """Publish `copies` (served dtype, on the host) as `version`: a delta where it can, else a full snapshot."""
        weight_delta.check_version(version)
        if not self.started:  # what an earlier run left names versions of other weights: never a base here
            for sub in (weight_delta.FULL_DIR, weight_delta.DELTA_DIR):
                shutil.rmtree(self.root / sub, ignore_errors=True)
            self.started = True
        full_bytes = sum(t.numel() * t.element_size() for _, t in copies)
        if self.mode == "delta" and self.tracker.usable(copies) and self.chain_bytes < full_bytes:
            blob, stats = self.tracker.encode(copies, version)
            path = weight_delta.delta_file(self.root, version)
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f".staging-{path.name}-{os.getpid()}")
            staging.write_bytes(blob)
            _replace(staging, path)
            self.chain_bytes += len(blob)
            self.tracker.commit(copies, version)
            return {"mode": "delta", "published_bytes": len(blob), "changed_fraction": stats.changed_fraction}
        self.publish_full(copies, version)
        return {"mode": "full", "published_bytes": full_bytes, "changed_fraction": 1.0}

    def publish_full(self, copies: list[tuple[str, torch.Tensor]], version: str) -> Path:
        """A full snapshot of `version` (with the base model's config and tokenizer: SGLang can load it); deltas and
        snapshots before the previous snapshot go (an engine may still be reading that one)."""
        final = weight_delta.full_dir(self.root, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.with_name(f".staging-{final.name}-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        safetensors_io.write(staging / "model.safetensors", copies,
                             metadata={"format": "pt", "weight_version": version})
        if self.base_model_dir:
            copy_side_files(self.base_model_dir, staging)
        older = sorted((p for p in final.parent.iterdir() if p.is_dir() and not p.name.startswith(".")
                        and p != final), key=lambda p: p.stat().st_mtime)
        stale_deltas = list((self.root / weight_delta.DELTA_DIR).glob("*.delta"))
        _replace(staging, final)
        for path in stale_deltas:  # every engine behind this snapshot starts from it now
            path.unlink(missing_ok=True)
        for path in older[:-1]:
            shutil.rmtree(path, ignore_errors=True)
        self.chain_bytes = 0
        self.tracker.commit(copies, version)
        return final

    def has_full(self, version: str) -> bool:
        return (weight_delta.full_dir(self.root, version) / "model.safetensors").is_file()


class DiskBroadcaster(WeightBroadcaster):
    """set_engines / broadcast / close as WeightBroadcaster, through the shared directory instead of a group."""

    def __init__(self, engine_urls: list[str], *, disk_dir: str | Path, update_weight_mode: str = "delta",
                 delta: DeltaSettings | None = None, **kwargs) -> None:
        super().__init__(engine_urls, **{**kwargs, "backend": "gloo"})
        if not disk_dir:
            raise ValueError("weight_sync_backend disk needs update_weight_disk_dir")
        self.requested_backend = self.backend = "disk"
        self.publisher = Publisher(disk_dir, mode=update_weight_mode, delta=delta, base_model_dir=self.model_dir)

    @property
    def pull_source(self) -> str:
        """Where a joining engine catches up from (its /update_weights_from_disk pulls from a store like this)."""
        return str(self.publisher.root)

    def init_group(self) -> None:
        """No process group: check the engines answer, learn the dtype they serve, keep a client for each."""
        self._drop_group()
        clients = [SGLangClient(url, timeout_s=self.timeout_s) for url in self.engine_urls]
        try:
            _on_all(clients, "health check", self._check_health, self.timeout_s + 1)
            infos = [info or {} for info in _on_all(clients, "get_server_info", lambda c: c.server_info(),
                                                    self.timeout_s + 1, ignore_errors=True)]
        except BaseException:
            for client in clients:
                client.close()
            raise
        self.dtype = wire.common_dtype(infos, self.model_dir)
        self.clients = clients

    def _ready(self) -> bool:
        return bool(self.clients)

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> dict:
        """Publish the version (before pausing: generation goes on meanwhile), pause, every engine pulls it (a full
        snapshot repairs one that cannot), continue. Returns stats with `mode`, `bytes` published, `repaired`."""
        start = time.monotonic()
        stats = self._begin_broadcast(weight_version, num_buckets=1)
        if not self.engine_urls:
            return stats
        copies = self.publisher.tracker.stage(named_tensors, self.dtype)
        root = str(self.publisher.root)
        try:
            published = self.publisher.publish(copies, weight_version)
            paused_at = time.monotonic()
            _on_all(self.clients, "pause_generation", lambda c: c.pause_generation(self.pause_mode),
                    self.timeout_s + 1)
            replies = _on_all(self.clients, "pull_weights", lambda c: self._pull(c, root, weight_version),
                              self.timeout_s + 1, ignore_errors=True)
            repaired = [c.url for c, r in zip(self.clients, replies, strict=True) if r != "ok"]
            if repaired:
                self._repair(copies, weight_version, repaired)
            _on_all(self.clients, "continue_generation", lambda c: c.continue_generation(), self.timeout_s + 1)
            stats["pause_seconds"] = time.monotonic() - paused_at
        except Exception as err:
            self.publisher.tracker.reset()
            failed = self._recover(err)
            raise WeightSyncError(f"disk weight sync of version {weight_version} to {self.engine_urls} failed after "
                                  f"{time.monotonic() - start:.1f} s: {err}", failed) from err
        stats.update(seconds=time.monotonic() - start, num_tensors=len(copies), mode=published["mode"],
                     bytes=published["published_bytes"], changed_fraction=published["changed_fraction"],
                     full_bytes=sum(t.numel() * t.element_size() for _, t in copies), repaired=repaired)
        log.info("weights version %s published (%s, %.2f MB) under %s and pulled by %d engines (%d repaired from a "
                 "full snapshot) in %.2f s", weight_version, published["mode"], stats["bytes"] / 1e6, root,
                 len(self.clients), len(repaired), stats["seconds"])
        return stats

    def _pull(self, client: SGLangClient, root: str, version: str) -> str:
        """"ok", or why the engine could not reach `version` from what is published (it needs a full snapshot)."""
        try:
            client.pull_weights(root, version, timeout_s=self.timeout_s)
        except PhysarumError as err:
            log.warning("engine %s: pull of version %s failed, a full snapshot follows: %s", client.url, version, err)
            return str(err)
        return "ok"

    def _repair(self, copies: list[tuple[str, torch.Tensor]], version: str, urls: list[str]) -> None:
        if not self.publisher.has_full(version):
            self.publisher.publish_full(copies, version)
        clients = [c for c in self.clients if c.url in urls]
        _on_all(clients, "pull_weights (full snapshot)", lambda c: c.pull_weights(str(self.publisher.root), version,
                                                                                  timeout_s=self.timeout_s),
                self.timeout_s + 1)

    def close(self) -> None:
        self._drop_group()
