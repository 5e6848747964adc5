"""The weight broadcast end to end: this test process is the trainer (rank 0), two CPU engine processes join.

The tests run in file order and share the engines: broadcast to both, a dead engine, a hung engine, a silent
trainer, and loading from disk.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import torch

from services.common.errors import FailedPrecondition
from services.common.sglang import SGLangClient
from services.trainer.weight_sync.weight_sync import WeightBroadcaster, WeightSyncError
from testkit.engines import start_engines, stop_engines
from tests.integration.hf_weights import hf_weights, perturbed

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def engines(tiny_model_dir, session_dir):
    engines = start_engines(tiny_model_dir, session_dir / "test_weight_sync", 2,
                            "--weight-sync-timeout-s", str(TIMEOUT_S))
    yield engines
    stop_engines(engines)


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir) -> dict[str, torch.Tensor]:
    """The tiny model's weights by HF name, each once (the tied lm_head.weight is the embedding)."""
    weights = hf_weights(tiny_model_dir)
    assert "lm_head.weight" not in weights
    return weights


@pytest.fixture(scope="module")
def broadcaster(engines):
    sync = WeightBroadcaster([url for _, url in engines], timeout_s=TIMEOUT_S, bucket_bytes=256 << 10)
    yield sync
    sync.close()


def engine_weights(url: str, name: str, numel: int) -> torch.Tensor:
    reply = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": numel}, timeout=30)
    reply.raise_for_status()
    return torch.tensor(reply.json(), dtype=torch.float32)


def assert_engine_has(url: str, weights: dict[str, torch.Tensor], version: str) -> None:
    for name, tensor in weights.items():
        assert torch.equal(engine_weights(url, name, tensor.numel()), tensor.flatten()), f"{url}: {name}"
    embed = weights["model.embed_tokens.weight"]
    assert torch.equal(engine_weights(url, "lm_head.weight", embed.numel()), embed.flatten())  # tied
    out = httpx.post(f"{url}/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
                     timeout=30).json()
    assert out["meta_info"]["weight_version"] == version
    assert httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"] == version


def test_update_outside_a_session_is_rejected(engines):
    reply = httpx.post(f"{engines[0][1]}/update_weights_from_distributed",
                       json={"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]]}, timeout=10)
    assert reply.status_code == 400
    assert reply.json()["success"] is False
    assert "between begin_weight_update() and end_weight_update()" in reply.json()["message"]


def test_broadcast_reaches_every_engine(engines, broadcaster, base_weights):
    weights = perturbed(base_weights, seed=1)
    stats = broadcaster.broadcast(weights.items(), "v1")
    assert stats["num_tensors"] == len(weights)
    assert stats["bytes"] == sum(t.numel() * 4 for t in weights.values())
    assert stats["num_buckets"] == pytest.approx(stats["bytes"] / (256 << 10), abs=3) and stats["num_buckets"] > 1
    for _, url in engines:
        assert_engine_has(url, weights, "v1")
    group = broadcaster.group
    weights = perturbed(base_weights, seed=2)
    broadcaster.broadcast(weights.items(), "v2")
    assert broadcaster.group is group  # the group is reused while the engines stay the same
    for _, url in engines:
        assert_engine_has(url, weights, "v2")


def test_dead_engine_fails_fast_and_the_live_one_takes_the_next_broadcast(engines, broadcaster, base_weights):
    (_, live_url), (dead_proc, dead_url) = engines
    dead_proc.signal(signal.SIGKILL)
    dead_proc.popen.wait(timeout=10)
    weights = perturbed(base_weights, seed=3)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=dead_url):
        broadcaster.broadcast(weights.items(), "v3")
    assert time.monotonic() - start < TIMEOUT_S + 1
    assert broadcaster.group is None  # dropped, to be rebuilt
    assert_engine_has(live_url, perturbed(base_weights, seed=2), "v2")  # unchanged and not left paused
    broadcaster.set_engines([live_url])
    broadcaster.broadcast(weights.items(), "v3")
    assert_engine_has(live_url, weights, "v3")


def test_hung_engine_times_out_then_rejoins(engines, broadcaster, base_weights):
    proc, url = engines[0]
    weights = perturbed(base_weights, seed=4)
    proc.signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="pause_generation"):
            broadcaster.broadcast(weights.items(), "v4")
        elapsed = time.monotonic() - start
    finally:
        proc.signal(signal.SIGCONT)
    assert TIMEOUT_S - 0.5 < elapsed < TIMEOUT_S + 1.5
    broadcaster.broadcast(weights.items(), "v4")  # rebuilds the group; the engine drops its stale one first
    assert_engine_has(url, weights, "v4")


def test_engine_gives_up_on_a_silent_trainer_and_keeps_serving(engines, broadcaster, base_weights):
    url = engines[0][1]
    assert broadcaster.group is not None
    with SGLangClient(url, timeout_s=TIMEOUT_S * 3) as engine:
        engine.begin_weight_update()
        start = time.monotonic()
        with pytest.raises(FailedPrecondition, match=f"Timed out waiting {int(TIMEOUT_S * 1000)}ms for recv"):
            engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[128]], "never")
        assert TIMEOUT_S - 0.5 < time.monotonic() - start < TIMEOUT_S + 2  # the group's timeout, no hang
        engine.end_weight_update()
    assert_engine_has(url, perturbed(base_weights, seed=4), "v4")  # unchanged, still serving
    broadcaster.init_group()  # a fresh group for both sides
    weights = perturbed(base_weights, seed=6)
    broadcaster.broadcast(weights.items(), "v6")
    assert_engine_has(url, weights, "v6")


def test_update_weights_from_disk(engines, base_weights, tmp_path):
    from safetensors.torch import save_file

    url = engines[0][1]
    weights = perturbed(base_weights, seed=5)
    save_file(weights, str(tmp_path / "model.safetensors"))
    reply = httpx.post(f"{url}/update_weights_from_disk",
                       json={"model_path": str(tmp_path), "weight_version": "disk-1"}, timeout=30).json()
    assert reply["success"] is True, reply
    assert_engine_has(url, weights, "disk-1")
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({**weights, "model.norm.weight": torch.zeros(3)}, str(bad / "model.safetensors"))
    reply = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(bad), "weight_version": "bad"},
                       timeout=30)
    assert reply.status_code == 400 and "model.norm.weight" in reply.json()["message"]
    assert_engine_has(url, weights, "disk-1")  # nothing changed
