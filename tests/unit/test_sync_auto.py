"""weight_sync_backend auto picks the shared-memory path exactly when every engine is on this trainer's host."""

from __future__ import annotations

import socket

from services.trainer.sync import auto
from services.trainer.sync.shm import SharedMemoryBroadcaster
from services.trainer.sync.weight_sync import WeightBroadcaster


def test_same_host_needs_every_engine_on_this_host():
    assert auto.same_host(["http://127.0.0.1:30000", "http://localhost:30001"])
    assert auto.same_host([f"http://{socket.gethostname()}:30000"])
    assert not auto.same_host(["http://127.0.0.1:30000", "http://10.255.0.7:30000"])
    assert not auto.same_host([])


def test_auto_moves_between_paths_as_the_engines_move(tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "SHM_ROOT", tmp_path)
    sync = auto.AutoBroadcaster([], timeout_s=5.0)
    try:
        sync.set_engines(["http://127.0.0.1:30000"])
        assert isinstance(sync.active, SharedMemoryBroadcaster) and sync.backend == "shm"
        assert sync.shm.engine_urls == ["http://127.0.0.1:30000"] and sync.group.engine_urls == []
        sync.set_engines(["http://10.255.0.7:30000"])
        assert type(sync.active) is WeightBroadcaster and sync.active.requested_backend == "auto"
        assert sync.group.engine_urls == ["http://10.255.0.7:30000"] and sync.shm.engine_urls == []
    finally:
        sync.close()


def test_make_broadcaster_names_each_backend():
    assert isinstance(auto.make_broadcaster("auto", []), auto.AutoBroadcaster)
    assert isinstance(auto.make_broadcaster("shm", []), SharedMemoryBroadcaster)
    gloo = auto.make_broadcaster("gloo", [])
    assert type(gloo) is WeightBroadcaster and gloo.backend == "gloo"
