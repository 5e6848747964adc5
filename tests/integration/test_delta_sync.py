"""Delta weight sync pushed through the weight-update group: this test process is the trainer (rank 0), two CPU
engine processes serve bf16 and join over gloo. The tests run in file order and share the engines: the first sync is
full, then deltas; a corrupted delta is repaired; an engine at another version gets a full copy. After each sync
every engine's tensors equal the trainer's in bf16 bit for bit.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from services.common import weight_delta
from services.trainer.settings.weight_sync import DeltaSettings
from services.trainer.weight_sync.delta_push import DeltaBroadcaster
from services.trainer.weight_sync.weight_sync import buckets
from testkit.engines import start_engines, stop_engines
from tests.integration.delta_checks import assert_engines_hold, sign_steps

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def engines(tiny_model_dir, session_dir):
    engines = start_engines(tiny_model_dir, session_dir / "test_delta_sync", 2, "--dtype", "bfloat16",
                            "--weight-sync-timeout-s", str(TIMEOUT_S))
    yield [url for _, url in engines]
    stop_engines(engines)


@pytest.fixture(scope="module")
def sync(engines):
    broadcaster = DeltaBroadcaster(engines, timeout_s=TIMEOUT_S, bucket_bytes=256 << 10,
                                   delta=DeltaSettings("xor", "xxh3-128"))
    yield broadcaster
    broadcaster.close()


@pytest.fixture(scope="module")
def steps(tiny_model_dir) -> list[dict[str, torch.Tensor]]:
    return sign_steps(tiny_model_dir, 5)


def test_first_sync_is_full_then_deltas_keep_engines_exact(engines, sync, steps):
    stats = sync.broadcast(steps[0].items(), "0")
    assert stats["mode"] == "full"
    assert_engines_hold(engines, steps[0], "0")
    for i in (1, 2):
        stats = sync.broadcast(steps[i].items(), str(i))
        assert stats["mode"] == "delta" and stats["repaired"] == []
        assert 0 < stats["changed_fraction"] < 1
        assert stats["bytes"] < stats["full_bytes"]
        assert_engines_hold(engines, steps[i], str(i))


def test_a_corrupted_delta_is_caught_by_its_checksum_and_repaired_in_full(engines, sync, steps, monkeypatch):
    encode = sync.tracker.encode
    corrupted = []

    def corrupting(named, version):
        blob, stats = encode(named, version)
        _, entries, payloads = weight_delta.unpack(blob)
        victim = max(entries, key=lambda e: e.length)  # flip a byte in the middle of the largest payload
        blob[len(blob) - len(payloads) + victim.offset + victim.length // 2] ^= 0x5A
        corrupted.append(victim.name)
        return blob, stats

    monkeypatch.setattr(sync.tracker, "encode", corrupting)
    stats = sync.broadcast(steps[4].items(), "4")
    assert stats["mode"] == "delta" and stats["repaired"] == corrupted
    assert_engines_hold(engines, steps[4], "4")


def test_an_engine_at_another_version_gets_a_full_copy(engines, sync, steps):
    reply = httpx.post(f"{engines[1]}/update_weight_version", json={"new_version": "elsewhere"}, timeout=10)
    assert reply.status_code == 200
    stats = sync.broadcast(steps[5].items(), "5")
    assert stats["mode"] == "full"
    assert_engines_hold(engines, steps[5], "5")
    stats = sync.broadcast(steps[4].items(), "6")  # and deltas resume from there (here a step back)
    assert stats["mode"] == "delta"
    assert_engines_hold(engines, steps[4], "6")



def test_a_delta_in_parts_keeps_engines_exact_and_a_failed_part_sends_the_rest_in_full(engines, sync, steps,
                                                                                       monkeypatch):
    monkeypatch.setattr(sync, "part_bytes", 64 << 10)  # the tiny model in many parts, each encoded while one ships
    parts = [[name for name, _ in part] for part in buckets(
        [(name, t.to(torch.bfloat16)) for name, t in steps[1].items()], sync.part_bytes)]  # as the engines serve
    assert len(parts) >= 3
    encode, calls = sync.tracker.encode, []

    def recording(named, version):
        calls.append(([name for name, _ in named], version))
        return encode(named, version)

    monkeypatch.setattr(sync.tracker, "encode", recording)
    stats = sync.broadcast(steps[1].items(), "7")
    assert stats["mode"] == "delta" and stats["repaired"] == []
    # every part but the last keeps the engines' version; they take the new one with the last
    assert calls == [(part, "6") for part in parts[:-1]] + [(parts[-1], "7")]
    assert_engines_hold(engines, steps[1], "7")

    corrupted = []

    def corrupting_the_second(named, version):
        blob, part_stats = encode(named, version)
        if len(corrupted) == 1:  # the second part: flip a byte in the middle of its largest payload
            _, entries, payloads = weight_delta.unpack(blob)
            victim = max(entries, key=lambda e: e.length)
            blob[len(blob) - len(payloads) + victim.offset + victim.length // 2] ^= 0x5A
            corrupted.append(victim.name)
        elif not corrupted:
            corrupted.append(None)
        return blob, part_stats

    monkeypatch.setattr(sync.tracker, "encode", corrupting_the_second)
    stats = sync.broadcast(steps[2].items(), "8")
    unsent = [name for part in parts[2:] for name in part]
    assert stats["mode"] == "delta" and stats["repaired"] == sorted({corrupted[1], *unsent})
    assert_engines_hold(engines, steps[2], "8")
