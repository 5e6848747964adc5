"""weight_sync_backend shm end to end: this test process is the trainer, two CPU engine processes on the same host
load each version from host shared memory; a dead engine fails the sync in time and leaves the other serving."""

from __future__ import annotations

import signal
import time

import pytest

from services.trainer.weight_sync.shm import SharedMemoryBroadcaster
from services.trainer.weight_sync.weight_sync import WeightSyncError
from testkit.engines import start_engines, stop_engines
from tests.integration.hf_weights import hf_weights, perturbed
from tests.integration.test_weight_sync import TIMEOUT_S, assert_engine_has

pytestmark = pytest.mark.slow  # two engines, about 40 s on 2 cores


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir):
    return hf_weights(tiny_model_dir)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, session_dir):
    engines = start_engines(tiny_model_dir, session_dir / "test_shm_sync", 2, "--weight-sync-timeout-s",
                            str(TIMEOUT_S))
    yield engines
    stop_engines(engines)


def test_same_host_engines_load_each_version_from_shared_memory(engines, base_weights, tiny_model_dir, tmp_path):
    sync = SharedMemoryBroadcaster([url for _, url in engines], timeout_s=TIMEOUT_S, model_dir=tiny_model_dir,
                                   root=tmp_path)
    try:
        for version, seed in (("s1", 1), ("s2", 2)):
            weights = perturbed(base_weights, seed=seed)
            stats = sync.broadcast(weights.items(), version)
            assert stats["bytes"] == sum(t.numel() * 4 for t in weights.values())
            for _, url in engines:
                assert_engine_has(url, weights, version)
        assert len(list(sync.root.iterdir())) == 1  # only the newest snapshot stays in memory

        (live_proc, live_url), (dead_proc, dead_url) = engines
        dead_proc.signal(signal.SIGKILL)
        dead_proc.popen.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=dead_url):
            sync.broadcast(perturbed(base_weights, seed=3).items(), "s3")
        assert time.monotonic() - start < TIMEOUT_S + 2
        assert_engine_has(live_url, perturbed(base_weights, seed=2), "s2")  # unchanged, not left paused
    finally:
        sync.close()
    assert not sync.root.exists()
