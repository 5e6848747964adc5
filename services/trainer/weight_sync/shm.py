"""weight_sync_backend shm: the weight broadcast to engines on this trainer's host through host shared memory.

The weights are written once, as a safetensors file under /dev/shm (tmpfs: memory, no disk), and every engine loads
them with SGLang's /update_weights_from_disk (safetensors maps the file; no process group, no second GPU, no
pickled tensors). For a one-GPU machine or colocated pods sharing /dev/shm, where NCCL cannot join two processes on
one device. Pausing, timeouts and resuming the engines after a failure are the broadcaster's, as for gloo and NCCL.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from services.common.sglang import SGLangClient
from services.common.weight_copies import SHM_ROOT, default_root, remove_stale, snapshot_dir  # noqa: F401 - auto.py reads SHM_ROOT here
from services.trainer.weight_sync.weight_sync import WeightBroadcaster, WeightSyncError, _on_all, write_snapshot

log = logging.getLogger(__name__)


class SharedMemoryBroadcaster(WeightBroadcaster):
    """set_engines / broadcast / close as WeightBroadcaster, through a shared-memory snapshot instead of a group."""

    def __init__(self, engine_urls: list[str], *, root: str | Path | None = None, **kwargs) -> None:
        super().__init__(engine_urls, **{**kwargs, "backend": "gloo"})
        self.requested_backend = self.backend = "shm"
        base = Path(root) if root is not None else default_root()
        remove_stale(base)  # a trainer that died before (SIGKILL) left its copy: this one's restart removes it
        self.root = snapshot_dir(base, self.job_id)

    def init_group(self) -> None:
        """No process group: check the engines answer, and keep a client for each."""
        self._drop_group()
        clients = [SGLangClient(url, timeout_s=self.timeout_s) for url in self.engine_urls]
        try:
            _on_all(clients, "health check", self._check_health, self.timeout_s + 1)
        except BaseException:
            for client in clients:
                client.close()
            raise
        self.clients = clients

    def _ready(self) -> bool:
        return bool(self.clients)  # no group here: the engines are set up once each has a client

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> dict:
        start = time.monotonic()
        stats = self._begin_broadcast(weight_version, num_buckets=1)
        if not self.engine_urls:
            return stats
        wait_s = self.timeout_s + 1
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        try:
            path = write_snapshot(named, self.root, weight_version, base_model_dir=self.model_dir, keep=1)
            paused_at = time.monotonic()
            # every engine paused before any loads (an engine gone leaves the others at the old version), then each
            # loads and continues on its own
            _on_all(self.clients, "pause_generation", lambda c: c.pause_generation(self.pause_mode), wait_s)
            _on_all(self.clients, "update_weights_from_disk, continue_generation",
                    lambda c: (c.update_weights_from_disk(path, weight_version), c.continue_generation()), wait_s)
            stats["pause_seconds"] = time.monotonic() - paused_at
        except Exception as err:
            failed = self._recover(err)
            raise WeightSyncError(f"shared-memory weight sync of version {weight_version} to {self.engine_urls} "
                                  f"failed after {time.monotonic() - start:.1f} s: {err}", failed) from err
        stats.update(seconds=time.monotonic() - start, num_tensors=len(named),
                     bytes=sum(t.numel() * t.element_size() for _, t in named))
        log.info("weights version %s: %.1f MB through %s to %d engines in %.2f s", weight_version,
                 stats["bytes"] / 1e6, path, len(self.clients), stats["seconds"])
        return stats

    def close(self) -> None:
        self._drop_group()
        shutil.rmtree(self.root, ignore_errors=True)
