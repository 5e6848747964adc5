"""The weight broadcast (gloo, SGLang's protocol) reaches CPU engine processes serving other families: Qwen3.5
(hybrid linear attention, tied embeddings) in float32 and DeepSeek-V3 (MLA and MoE, untied, a float32 router kept
in float32 by transformers) in bfloat16. This test process is the trainer: it trains one GRPO step, broadcasts,
and the engines then hold its weights (in their own dtype) and score their generations as the trainer does."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.common.samples import Sample
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.settings.train import TrainConfig
from services.trainer.weight_sync.weight_sync import WeightBroadcaster
from testkit.engines import start_engines, stop_engines
from tests.tiny_samples import samples_of

ROLLOUT = [("12+34=", "46", 1.0), ("12+34=", "55", 0.0), ("1+2=", "3", 0.0), ("1+2=", "4", 1.0)]
SERVED = {"qwen3_5": "float32", "deepseek_v3": "bfloat16"}
# two engine processes (~40 s on 2 cores); every family's weights also reach an in-process engine from disk in
# tests/unit/test_families_train_and_serve.py
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(family_model_dir, session_dir):
    started = {family: start_engines(family_model_dir(family), session_dir / f"family-sync-{family}", 1,
                                     "--dtype", dtype, "--weight-sync-timeout-s", "30")
               for family, dtype in SERVED.items()}
    yield {family: url for family, [(_, url)] in started.items()}
    for engine in started.values():
        stop_engines(engine)


def engine_tensor(url: str, name: str, numel: int) -> torch.Tensor:
    reply = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": numel}, timeout=30)
    reply.raise_for_status()
    return torch.tensor(reply.json(), dtype=torch.float32)


def greedy(url: str, input_ids: list[int]) -> tuple[list[int], list[float]]:
    body = {"input_ids": input_ids, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}}
    meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    assert meta["weight_version"] == "1"
    return [tok for _, tok, _ in meta["output_token_logprobs"]], [lp for lp, _, _ in meta["output_token_logprobs"]]


@pytest.mark.parametrize("family", list(SERVED))
def test_the_broadcast_reaches_an_engine_of_the_family(engines, family_model_dir, family):
    model_dir, url = family_model_dir(family), engines[family]
    backend = TorchBackend(model_dir, TrainConfig(n_samples_per_prompt=2, lr=1e-3), num_threads=1)
    samples = samples_of(model_dir, ROLLOUT)
    backend.train_rollout(samples)
    weights = dict(backend.named_weights())
    with WeightBroadcaster([url], timeout_s=30.0, bucket_bytes=64 << 10, model_dir=model_dir) as broadcaster:
        stats = broadcaster.broadcast(weights.items(), "1")
    dtype = getattr(torch, SERVED[family])
    assert stats["num_tensors"] == len(weights)
    assert ("lm_head.weight" in weights) == (family != "qwen3_5")  # tied: the embedding is sent once
    for name, tensor in weights.items():  # each weight as the engine serves it: in its dtype
        assert torch.equal(engine_tensor(url, name, tensor.numel()), tensor.to(dtype).float().flatten()), name
    for sample in samples[::2]:
        prompt = sample.tokens[:sample.prompt_length]
        output_ids, log_probs = greedy(url, prompt)
        (trained,) = backend.compute_log_probs([Sample(tokens=prompt + output_ids, response_length=3)])
        assert log_probs == pytest.approx(trained, abs=1e-5 if dtype == torch.float32 else 0.1)
