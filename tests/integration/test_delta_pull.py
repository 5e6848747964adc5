"""Delta weight sync pulled from shared storage (weight_sync_backend disk): this test process is the trainer, which
publishes each version under a directory; two CPU engine processes (bf16) pull it. The tests run in file order and
share the engines: full then deltas, a corrupted delta, a missing delta, and an engine that joins late and catches
up from the newest full snapshot plus the deltas after it. After each sync the engines hold the trainer's weights in
bf16 bit for bit.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from services.common import weight_delta
from services.trainer.settings.weight_sync import DeltaSettings
from services.trainer.weight_sync.delta_disk import DiskBroadcaster
from testkit.engines import start_engines, stop_engines
from tests.integration.delta_checks import assert_engines_hold, sign_steps

TIMEOUT_S = 30.0
ENGINE_ARGS = ("--dtype", "bfloat16", "--weight-sync-timeout-s", str(TIMEOUT_S))


@pytest.fixture(scope="module")
def engines(tiny_model_dir, session_dir):
    engines = start_engines(tiny_model_dir, session_dir / "test_delta_pull", 2, *ENGINE_ARGS)
    yield [url for _, url in engines]
    stop_engines(engines)


@pytest.fixture(scope="module")
def sync(engines, tmp_path_factory):
    broadcaster = DiskBroadcaster(engines, disk_dir=tmp_path_factory.mktemp("weights"), timeout_s=TIMEOUT_S,
                                  update_weight_mode="delta", delta=DeltaSettings("overwrite", "adler32"))
    yield broadcaster
    broadcaster.close()


@pytest.fixture(scope="module")
def steps(tiny_model_dir) -> list[dict[str, torch.Tensor]]:
    return sign_steps(tiny_model_dir, 7, lr=2e-5)  # small steps: the deltas stay well under a model


def published(sync: DiskBroadcaster) -> tuple[list[str], list[str]]:
    root = sync.publisher.root
    return (sorted(p.name for p in (root / weight_delta.FULL_DIR).iterdir()),
            sorted(p.stem for p in (root / weight_delta.DELTA_DIR).glob("*.delta")))


def test_engines_pull_a_full_snapshot_then_deltas(engines, sync, steps):
    stats = sync.broadcast(steps[0].items(), "0")
    assert stats["mode"] == "full" and stats["repaired"] == []
    assert_engines_hold(engines, steps[0], "0")
    for i in (1, 2):
        stats = sync.broadcast(steps[i].items(), str(i))
        assert stats["mode"] == "delta" and stats["repaired"] == []
        assert stats["bytes"] < stats["full_bytes"] and 0 < stats["changed_fraction"] < 1
        assert_engines_hold(engines, steps[i], str(i))
    assert published(sync) == (["0"], ["1", "2"])


def test_a_corrupted_delta_is_caught_and_repaired_from_a_full_snapshot(engines, sync, steps, monkeypatch):
    encode = sync.publisher.tracker.encode

    def corrupting(named, version):
        blob, stats = encode(named, version)
        _, entries, payloads = weight_delta.unpack(blob)
        victim = max(entries, key=lambda e: e.length)
        blob[len(blob) - len(payloads) + victim.offset + victim.length // 2] ^= 0x5A
        return blob, stats

    monkeypatch.setattr(sync.publisher.tracker, "encode", corrupting)
    stats = sync.broadcast(steps[3].items(), "3")
    assert stats["mode"] == "delta" and sorted(stats["repaired"]) == sorted(engines)
    assert_engines_hold(engines, steps[3], "3")
    assert published(sync) == (["0", "3"], [])  # the repair's snapshot; the deltas before it are gone


def test_a_missing_delta_is_repaired_from_a_full_snapshot(engines, sync, steps):
    sync.set_engines(engines[:1])  # engine 1 misses version 4
    assert sync.broadcast(steps[4].items(), "4")["mode"] == "delta"
    weight_delta.delta_file(sync.publisher.root, "4").unlink()  # and its delta is lost
    sync.set_engines(engines)
    stats = sync.broadcast(steps[5].items(), "5")
    assert stats["repaired"] == [engines[1]]
    assert_engines_hold(engines, steps[5], "5")


def test_a_late_joiner_catches_up_from_the_newest_snapshot_and_the_deltas_after_it(engines, sync, steps,
                                                                                     tiny_model_dir, session_dir):
    assert sync.broadcast(steps[6].items(), "6")["mode"] == "delta"
    assert sync.broadcast(steps[7].items(), "7")["mode"] == "delta"
    fulls, deltas = published(sync)
    assert fulls[-1] == "5" and deltas == ["6", "7"]
    joiner = start_engines(tiny_model_dir, session_dir / "test_delta_pull_joiner", 1, *ENGINE_ARGS)
    try:
        url = joiner[0][1]  # the rollout manager's call for a joiner, with the store as the snapshot
        reply = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": sync.pull_source,
                                                                    "weight_version": "7"}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["message"].endswith(": full 5, delta 6, delta 7.")
        assert_engines_hold([url], steps[7], "7")
    finally:
        stop_engines(joiner)


def test_pull_names_what_is_missing(engines, sync):
    reply = httpx.post(f"{engines[0]}/pull_weights", json={"source_dir": str(sync.publisher.root),
                                                           "target_version": "99"}, timeout=30)
    assert reply.status_code == 400
    assert "no full snapshot" in reply.json()["message"] and "version '99'" in reply.json()["message"]
