"""weight_sync_backend auto: the shared-memory path for engines on this trainer's host, a process group otherwise.

Engines on this host (a loopback URL, or this host's own name or address) load each version from /dev/shm, which
costs one write here and one read per engine; engines elsewhere join the weight-update group (NCCL from CUDA ranks
to GPU engines, gloo otherwise: `wire.auto_backend`). The choice is made for each set of engines the pool names.
"""

from __future__ import annotations

import functools
import logging
import socket
import urllib.parse
from collections.abc import Iterable

import torch

from services.trainer.settings.weight_sync import DeltaSettings
from services.trainer.weight_sync.delta_disk import DiskBroadcaster
from services.trainer.weight_sync.delta_push import DeltaBroadcaster
from services.trainer.weight_sync.shm import SHM_ROOT, SharedMemoryBroadcaster
from services.trainer.weight_sync.weight_sync import WeightBroadcaster
from services.trainer.weight_sync.wire import LOOPBACK

log = logging.getLogger(__name__)


@functools.cache
def _own_names() -> frozenset[str]:
    """This host's name and the addresses it resolves to (an engine URL naming one of them is on this host)."""
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        names |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return frozenset(names)


def same_host(urls: Iterable[str]) -> bool:
    """Whether every engine URL names this host (and there is at least one)."""
    hosts = [urllib.parse.urlsplit(url).hostname or "" for url in urls]
    return bool(hosts) and all(host in LOOPBACK or host in _own_names() for host in hosts)


class AutoBroadcaster:
    """set_engines / broadcast / close as WeightBroadcaster; each set of engines goes to the path that suits it."""

    def __init__(self, engine_urls: list[str], **kwargs) -> None:
        self.group = WeightBroadcaster([], **{**kwargs, "backend": "auto"})
        self.shm = SharedMemoryBroadcaster([], **kwargs)
        self.engine_urls: list[str] = []
        self.active: WeightBroadcaster = self.group
        self.set_engines(engine_urls)

    @property
    def backend(self) -> str:
        return self.active.backend

    def set_engines(self, urls: list[str]) -> None:
        local = same_host(urls) and SHM_ROOT.is_dir()
        active, idle = (self.shm, self.group) if local else (self.group, self.shm)
        if active is not self.active and urls:
            log.info("weight sync to %s: %s", urls, "shared memory (same host)" if local else "process group")
        if idle.engine_urls:  # the other path's group on the engines, or its snapshot in memory, goes
            idle.close()
            idle.set_engines([])
        active.set_engines(urls)
        self.active, self.engine_urls = active, list(urls)

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> dict:
        return self.active.broadcast(named_tensors, weight_version)

    def close(self) -> None:
        self.group.close()
        self.shm.close()

    def __enter__(self) -> AutoBroadcaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_broadcaster(backend: str, engine_urls: list[str], *, update_weight_mode: str = "full",
                     delta: DeltaSettings | None = None, disk_dir: str = "",
                     **kwargs) -> WeightBroadcaster | AutoBroadcaster:
    """The broadcaster of a weight_sync_backend (auto, shm, gloo, nccl or disk) and an update_weight_mode (full or
    delta; a delta over auto goes through the group, gloo or nccl as `wire.auto_backend` picks)."""
    if backend == "disk":
        return DiskBroadcaster(engine_urls, disk_dir=disk_dir, update_weight_mode=update_weight_mode, delta=delta,
                               **kwargs)
    if update_weight_mode == "delta":
        if backend == "shm":
            raise ValueError("update_weight_mode delta goes over weight_sync_backend gloo, nccl, auto or disk, not shm")
        return DeltaBroadcaster(engine_urls, backend=backend, delta=delta, **kwargs)
    if backend == "auto":
        return AutoBroadcaster(engine_urls, **kwargs)
    if backend == "shm":
        return SharedMemoryBroadcaster(engine_urls, **kwargs)
    return WeightBroadcaster(engine_urls, backend=backend, **kwargs)
