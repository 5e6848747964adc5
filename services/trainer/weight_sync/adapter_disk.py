"""A LoRA job's adapter sync, push or disk (the job's lora_sync). Disk is the route SGLang serves: each version is
written as PEFT's adapter directory where the engines read (the pool's snapshot, else update_weight_disk_dir) and
loaded with /load_lora_adapter under a versioned name, since SGLang replaces no adapter in place; the rollout manager's
requests move to that name once the sync ends (the engines report the version: /update_weight_version), and each
engine unloads the versions no request names any more.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from services.common.errors import FailedPrecondition, PhysarumError
from services.common.sglang import SGLangClient, serves_adapter_push, unversioned_adapter_name, versioned_adapter_name
from services.trainer.weight_sync.weight_sync import (
    ADAPTERS_DIR,
    AdapterPush,
    WeightBroadcaster,
    WeightSyncError,
    _on_all,
    write_adapter_snapshot,
)

log = logging.getLogger(__name__)

ROUTES = ("push", "disk")
DISK_SUBDIR = "lora-adapters"  # under update_weight_disk_dir, beside the full-weight store


def adapter_version(name: str, lora_name: str) -> int | None:
    """The version of `lora_name` that an engine's adapter `name` is (versioned_adapter_name), else None."""
    prefix = versioned_adapter_name(lora_name, "")
    rest = name.removeprefix(prefix)
    return int(rest) if name.startswith(prefix) and rest.isdigit() else None


def stale_versions(loaded: Iterable[str], lora_name: str, version: str) -> list[str]:
    """The versions of `lora_name` among `loaded` to unload once `version` is loaded: all but it and the newest one
    below it (the one the manager's requests name until this sync ends)."""
    current = int(version)
    older = sorted((v, name) for name in loaded if (v := adapter_version(name, lora_name)) is not None
                   and v != current)
    below = [name for v, name in older if v < current]
    keep = below[-1:]
    return [name for _, name in older if name not in keep]


class AdapterSync:
    """What sync_engine_pool drives for a LoRA job (set_engines, adapter_for, broadcast_adapter, close): the push
    through `push` (a WeightBroadcaster), or the disk route. lora_sync auto asks the engines at the first sync with
    engines: push when every one is a Physarum CPU engine, disk otherwise; the choice then holds for the job."""

    def __init__(self, push: WeightBroadcaster, *, lora_sync: str = "auto", disk_dir: str = "",
                 timeout_s: float = 60.0) -> None:
        if lora_sync not in ("auto", *ROUTES):
            raise ValueError(f"lora_sync must be auto, push or disk, got {lora_sync!r}")
        self.push = push
        self.route = lora_sync  # "auto" until resolved
        self.disk_dir = disk_dir
        self.timeout_s = timeout_s
        self.engine_urls: list[str] = []

    def set_engines(self, urls: list[str]) -> None:
        self.engine_urls = list(urls)
        if self.route != "disk":
            self.push.set_engines(urls)

    def resolve(self) -> str:
        """The route: lora_sync itself, or auto's choice once there are engines to ask ("auto" until then)."""
        if self.route == "auto" and self.engine_urls:
            clients = [SGLangClient(url, timeout_s=self.timeout_s) for url in self.engine_urls]
            try:
                infos = _on_all(clients, "get_server_info", lambda c: c.server_info(), self.timeout_s + 1)
            finally:
                for client in clients:
                    client.close()
            self.route = "push" if all(serves_adapter_push(info or {}) for info in infos) else "disk"
            log.info("lora_sync auto: %s (engines %s)", self.route, self.engine_urls)
        return self.route

    def adapter_for(self, adapter: AdapterPush, version: str) -> AdapterPush:
        """The adapter as the engines serve it at `version`: under a versioned name on the disk route."""
        if self.resolve() == "disk":
            return AdapterPush(versioned_adapter_name(adapter.lora_name, version), adapter.config)
        return adapter

    def broadcast_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str, *, lora_name: str,
                          config: dict, directory: str = "") -> dict:
        """Send the adapter as `version`; `directory`: its PEFT directory already written where the engines read
        (the pool's snapshot), else the disk route writes one under update_weight_disk_dir."""
        if self.resolve() != "disk":
            return self.push.broadcast_adapter(named_tensors, version, lora_name=lora_name, config=config)
        return self._load_from_disk(list(named_tensors), version, lora_name, config, directory)

    def _load_from_disk(self, named: list[tuple[str, torch.Tensor]], version: str, lora_name: str, config: dict,
                        directory: str) -> dict:
        start = time.monotonic()
        stats = {"seconds": 0.0, "pause_seconds": 0.0, "bytes": sum(t.numel() * t.element_size() for _, t in named),
                 "num_tensors": len(named), "num_buckets": 1, "num_engines": len(self.engine_urls), "mode": "disk"}
        if not self.engine_urls:
            log.warning("adapter %s: no engines", lora_name)
            return stats
        if not directory:
            if not self.disk_dir:
                raise WeightSyncError(f"lora_sync disk: nowhere the engines can read adapter {lora_name} from: the "
                                      f"rollout manager's pool has no snapshot directory (engine_join_mode sync) "
                                      f"and update_weight_disk_dir is not set")
            snapshot = write_adapter_snapshot(named, Path(self.disk_dir) / DISK_SUBDIR, version,
                                              AdapterPush(lora_name, config))
            directory = str(Path(snapshot, ADAPTERS_DIR, lora_name))
        base = unversioned_adapter_name(lora_name)
        clients = [SGLangClient(url, timeout_s=self.timeout_s) for url in self.engine_urls]
        try:
            # the version each engine reports (the pool checks it), set first: the CPU engine stamps an adapter it
            # loads with it, as SGLang reports its one version for every request
            _on_all(clients, f"update_weight_version to {version}",
                    lambda c: c.update_weight_version(version, timeout_s=self.timeout_s), self.timeout_s + 1)
            # no pause: a new name disturbs no request, and each engine serves the old one until the manager moves
            replies = _on_all(clients, f"load_lora_adapter of {lora_name} from {directory}",
                              lambda c: self._load(c, lora_name, directory), 3 * self.timeout_s + 1)
            _on_all(clients, f"unloading older versions of {base}",
                    lambda c: self._unload_stale(c, replies[clients.index(c)], base, version), self.timeout_s + 1,
                    ignore_errors=True)
        finally:
            for client in clients:
                client.close()
        stats["seconds"] = time.monotonic() - start
        log.info("adapter %s: %d tensors, %.2f MB loaded from %s by %d engines in %.2f s", lora_name, len(named),
                 stats["bytes"] / 1e6, directory, len(clients), stats["seconds"])
        return stats

    def _load(self, client: SGLangClient, name: str, directory: str) -> dict:
        """/load_lora_adapter; a refusal (SGLang refuses a name already loaded: a retried sync's) unloads the name
        and loads once more, which fails again, naming the cause, where the refusal was for another reason."""
        try:
            return client.load_lora_adapter(name, directory, timeout_s=self.timeout_s)
        except FailedPrecondition as err:
            log.warning("engine %s: loading adapter %s failed (%s); unloading the name and loading again", client.url,
                        name, err)
            with contextlib.suppress(PhysarumError):
                client.unload_lora_adapter(name, timeout_s=self.timeout_s)
            return client.load_lora_adapter(name, directory, timeout_s=self.timeout_s)

    def _unload_stale(self, client: SGLangClient, reply: dict | None, lora_name: str, version: str) -> None:
        """Unload the versions `reply` (the load's loaded_adapters) lists that no request names any more (SGLang
        lets the requests still on one finish first); one that fails is tried again at the next sync."""
        loaded = reply.get("loaded_adapters") if isinstance(reply, dict) else None
        for name in stale_versions(loaded if isinstance(loaded, dict) else (), lora_name, version):
            try:
                client.unload_lora_adapter(name, timeout_s=self.timeout_s)
            except PhysarumError as err:
                log.warning("engine %s: unloading %s (an older version of the adapter) failed, tried again at the "
                            "next sync: %s", client.url, name, err)

    def close(self) -> None:
        self.push.close()
