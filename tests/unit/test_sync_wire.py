"""The weight broadcast's wire: buckets on the backend's device in the engines' dtype, the deadline that frees a
blocked collective (NCCL's case) by aborting it, and the auto backend."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from services.trainer.weight_sync import wire
from services.trainer.weight_sync.weight_sync import WeightSyncError, _alongside


class Engine:
    def __init__(self, url: str) -> None:
        self.url = url


def test_buckets_go_to_host_memory_for_gloo_in_the_served_dtype():
    weights = [torch.full((2, 3), 1.5).t(), torch.arange(4)]  # a non-contiguous view and an integer tensor
    out = wire.on_the_wire(weights, backend="gloo", dtype=torch.bfloat16)
    assert [t.dtype for t in out] == [torch.bfloat16, torch.int64]  # integer tensors keep theirs
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in out)
    assert out[0].float().tolist() == [[1.5, 1.5]] * 3
    assert wire.on_the_wire(weights, backend="gloo", dtype=None)[0].dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_nccl_without_cuda_names_the_fix():
    with pytest.raises(ValueError, match="no CUDA device is visible.*use gloo"):
        wire.on_the_wire([torch.ones(1)], backend="nccl", dtype=None)


def test_a_blocked_local_side_is_aborted_at_the_deadline():
    released = threading.Event()
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="local side is still blocked after 0.5 s") as err:
        _alongside([Engine("http://a"), Engine("http://b")], "update", lambda i, c: time.sleep(0.05 if i else 30),
                   lambda: released.wait(30), 0.5, on_stuck=released.set)
    assert released.is_set() and time.monotonic() - start < 5
    assert err.value.failed_urls == ("http://a",)  # the engine that never answered


def test_a_failing_engine_aborts_at_once_without_waiting_for_the_deadline():
    released = threading.Event()

    def call(i, client):
        if i == 1:
            raise ConnectionError("connection refused")
        released.wait(30)

    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="http://b: connection refused") as err:
        _alongside([Engine("http://a"), Engine("http://b")], "update", call, lambda: released.wait(30), 20.0,
                   on_stuck=released.set)
    assert time.monotonic() - start < 10 and released.is_set()
    assert "http://b" in err.value.failed_urls


def test_a_completed_collective_returns():
    calls = []
    _alongside([Engine("http://a")], "update", lambda i, c: calls.append(i), lambda: calls.append("local"), 5.0,
               on_stuck=lambda: calls.append("aborted"))
    assert sorted(map(str, calls)) == ["0", "local"]


def test_served_dtype_reads_the_engine_then_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert wire.served_dtype({"dtype": "float32"}, tmp_path) == torch.float32
    assert wire.served_dtype({"dtype": "auto"}, tmp_path) == torch.bfloat16
    assert wire.served_dtype({}, None) is None
    assert wire.common_dtype([{"dtype": "float32"}, {"dtype": "bfloat16"}], None) is None
    assert wire.common_dtype([{"dtype": "half"}, {"dtype": "float16"}], None) == torch.float16


def test_auto_backend_is_nccl_only_from_cuda_to_remote_gpu_engines(monkeypatch):
    gpu, cpu = {"device": "cuda"}, {"device": "cpu"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert wire.auto_backend([gpu, gpu], ["http://10.0.0.5:30000", "http://10.0.0.6:30000"]) == "nccl"
    assert wire.auto_backend([gpu, cpu], ["http://10.0.0.5:30000", "http://10.0.0.6:30000"]) == "gloo"
    assert wire.auto_backend([gpu], ["http://127.0.0.1:30000"]) == "gloo"  # may share this trainer's GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert wire.auto_backend([gpu], ["http://10.0.0.5:30000"]) == "gloo"
