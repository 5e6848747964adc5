"""The fake-compute engine (no model, no torch): SGLang's stopping rules and reply fields, the per-token delay,
continuous batching, pause/abort, and weights as a version that update_weights_from_disk sets."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.engine.fake import FakeEngine, FakeWeights, safetensors_names
from services.engine.protocol import to_response
from services.engine.scheduler import Request, SamplingParams


@pytest.fixture
def engine(tiny_model_dir):
    engine = FakeEngine(str(tiny_model_dir), per_token_delay_s=0.01, seed=0).start()
    yield engine
    engine.stop()


def run(engine: FakeEngine, requests: list[Request], timeout_s: float = 10.0) -> list[Request]:
    finished = threading.Semaphore(0)
    for request in requests:
        request.on_finish = lambda r: finished.release()
    engine.submit(requests)
    for _ in requests:
        assert finished.acquire(timeout=timeout_s), "a request never finished"
    return requests


def test_replies_have_sglang_shapes_and_uniform_logprobs(engine, tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    (request,) = run(engine, [Request("r1", [5, 6], SamplingParams(max_new_tokens=6, ignore_eos=True))])
    reply = to_response(request, True, None)
    assert set(reply) == {"text", "output_ids", "meta_info"} and len(reply["output_ids"]) == 6
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert reply["meta_info"]["weight_version"] == "default" and reply["meta_info"]["completion_tokens"] == 6
    assert [e[0] for e in reply["meta_info"]["output_token_logprobs"]] == [pytest.approx(-math.log(vocab))] * 6
    assert all(0 <= t < vocab for t in reply["output_ids"]) and isinstance(reply["text"], str)


def test_a_prefill_only_request_scores_its_input(engine):
    """A teacher's call (on-policy distillation): max_new_tokens 0 with logprob_start_len gives SGLang's
    input_token_logprobs, uniform here, and generates nothing; a request behind it still generates."""
    scoring = Request("t", [5, 6, 7, 8], SamplingParams(max_new_tokens=0), logprob_start_len=1)
    generating = Request("g", [5], SamplingParams(max_new_tokens=2, ignore_eos=True))
    run(engine, [scoring, generating])
    reply = to_response(scoring, True, None)
    assert reply["output_ids"] == [] and reply["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    uniform = pytest.approx(-math.log(engine.vocab_size))
    assert reply["meta_info"]["input_token_logprobs"] == [[uniform, 6, None], [uniform, 7, None], [uniform, 8, None]]
    assert len(generating.output_ids) == 2 and generating.input_logprobs is None


def test_stop_token_ids_min_new_tokens_and_sampling_seed(engine):
    last = engine.vocab_size - 1
    stop = frozenset(range(last))  # every token but the last one stops...
    params = SamplingParams(max_new_tokens=50, min_new_tokens=3, stop_token_ids=stop, sampling_seed=7)
    first, second = run(engine, [Request("a", [1], params), Request("b", [1], params)])
    assert first.output_ids[:3] == [last] * 3  # ...but not before min_new_tokens
    assert first.finish_reason == {"type": "stop", "matched": first.output_ids[-1]} and first.output_ids[-1] in stop
    assert first.output_ids == second.output_ids  # the same seed draws the same tokens


def test_delay_per_token_and_continuous_batching(engine):
    start = time.monotonic()
    (long,) = run(engine, [Request("long", [1], SamplingParams(max_new_tokens=40, ignore_eos=True))])
    assert time.monotonic() - start >= 40 * 0.01
    requests = [Request(f"r{i}", [1], SamplingParams(max_new_tokens=30, ignore_eos=True)) for i in range(8)]
    start = time.monotonic()
    engine.submit(requests[:4])
    time.sleep(0.1)  # the batch runs; the next four join it instead of waiting for it to end
    run(engine, requests[4:])
    elapsed = max(r.finished_s for r in requests) - start
    assert 30 * 0.01 <= elapsed < 2 * 30 * 0.01 + 0.2, elapsed


def test_pause_abort_and_exclusive_weights(engine, tiny_model_dir, tmp_path):
    request = Request("slow", [1], SamplingParams(max_new_tokens=500, ignore_eos=True))
    done = threading.Event()
    request.on_finish = lambda r: done.set()
    engine.submit([request])
    time.sleep(0.05)
    engine.pause("abort", timeout_s=5)
    assert done.wait(5) and request.finish_reason["type"] == "abort"
    engine.resume()
    weights = FakeWeights(engine, timeout_s=5)
    names = safetensors_names(tiny_model_dir / "model.safetensors")
    assert "model.embed_tokens.weight" in names and "__metadata__" not in names
    assert f"({len(names)} tensors" in weights.update_from_disk(str(tiny_model_dir), weight_version="v9")
    assert engine.weight_version == "v9"
    (after,) = run(engine, [Request("after", [1], SamplingParams(max_new_tokens=2, ignore_eos=True))])
    assert after.weight_version == "v9"
    with pytest.raises(NotFound, match="no \\*.safetensors"):
        weights.update_from_disk(str(tmp_path), weight_version="v10")
    with pytest.raises(FailedPrecondition, match="needs the real engine"):
        weights.init_group(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2)
    assert engine.weight_version == "v9"
