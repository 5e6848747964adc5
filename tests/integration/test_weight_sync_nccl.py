"""The NCCL weight broadcast on a machine with two GPUs: this test process is the trainer on cuda:0, a CPU engine
serves on cuda:1. A silent engine (stopped mid-sync) fails the sync within the timeout (the blocked collective is
aborted), the engine is not left paused, and the next sync rebuilds the group. Skipped without two GPUs."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from services.trainer.weight_sync.weight_sync import WeightBroadcaster, WeightSyncError
from testkit.engines import start_engines, stop_engines
from tests.integration.hf_weights import hf_weights, perturbed
from tests.integration.test_weight_sync import TIMEOUT_S, assert_engine_has

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two processes needs two GPUs")


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir):
    return hf_weights(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, session_dir):
    engines = start_engines(tiny_model_dir, session_dir / "test_weight_sync_nccl", 1, "--device", "cuda:1",
                            "--weight-sync-timeout-s", str(TIMEOUT_S))
    yield engines[0]
    stop_engines(engines)


def test_nccl_sync_honours_its_timeout(engine, base_weights):
    torch.cuda.set_device(0)
    proc, url = engine
    cuda_weights = {name: t.cuda() for name, t in perturbed(base_weights, seed=1).items()}
    with WeightBroadcaster([url], backend="nccl", timeout_s=TIMEOUT_S, bucket_bytes=256 << 10) as sync:
        sync.broadcast(cuda_weights.items(), "n1")
        assert_engine_has(url, {k: v.cpu() for k, v in cuda_weights.items()}, "n1")
        proc.signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(WeightSyncError):
                sync.broadcast(perturbed(base_weights, seed=2).items(), "n2")  # CPU tensors: moved to cuda:0
            assert time.monotonic() - start < 3 * TIMEOUT_S
        finally:
            proc.signal(signal.SIGCONT)
        assert_engine_has(url, {k: v.cpu() for k, v in cuda_weights.items()}, "n1")  # answers: not left paused
        weights = perturbed(base_weights, seed=3)
        sync.broadcast(weights.items(), "n3")  # a new group
        assert_engine_has(url, weights, "n3")
