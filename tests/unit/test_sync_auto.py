"""weight_sync_backend auto picks the shared-memory path exactly when every engine is on this trainer's host."""

from __future__ import annotations

import socket

import pytest

from services.trainer.weight_sync import auto
from services.trainer.weight_sync.shm import SharedMemoryBroadcaster
from services.trainer.weight_sync.weight_sync import WeightBroadcaster


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


def test_delta_and_disk_settings_pick_their_broadcasters(tmp_path):
    from services.trainer.settings.weight_sync import DeltaSettings, SyncConfig
    from services.trainer.weight_sync.delta_disk import DiskBroadcaster
    from services.trainer.weight_sync.delta_push import DeltaBroadcaster

    options = SyncConfig(weight_sync_backend="disk", update_weight_mode="delta", update_weight_disk_dir=str(tmp_path),
                         update_weight_delta_encoding="overwrite").broadcaster_options()
    assert options["delta"] == DeltaSettings("overwrite", "xxh3-128")
    disk = auto.make_broadcaster("disk", [], **options)
    assert isinstance(disk, DiskBroadcaster) and disk.pull_source == str(tmp_path)
    assert isinstance(auto.make_broadcaster("auto", [], update_weight_mode="delta"), DeltaBroadcaster)
    with pytest.raises(ValueError, match="not shm"):
        auto.make_broadcaster("shm", [], update_weight_mode="delta")
    with pytest.raises(ValueError, match="needs update_weight_disk_dir"):
        SyncConfig(weight_sync_backend="disk")
    with pytest.raises(ValueError, match="not shm"):
        SyncConfig(weight_sync_backend="shm", update_weight_mode="delta")
