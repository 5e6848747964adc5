"""The CPU engine as a real process: SGLang's /generate shapes, log-probs, stopping, pause/abort, model info."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import pytest
import torch

META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
             "e2e_latency"}
EOS_ID = 0  # tinymodel: eos = pad = "<|endoftext|>"


@pytest.fixture(scope="module")
def engine_url(cpu_engine_url):
    return cpu_engine_url


@pytest.fixture(scope="module")
def http(engine_url):
    with httpx.Client(base_url=engine_url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def generate(http: httpx.Client, **body):
    reply = http.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_single_request_shape(http):
    out = generate(http, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0.7},
                   return_logprob=True, rid="shape-1")
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert META_KEYS | {"output_token_logprobs"} == set(meta)
    assert meta["id"] == "shape-1"
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0
    assert [entry[1:] for entry in meta["output_token_logprobs"]] == [[t, None] for t in out["output_ids"]]
    assert all(entry[0] < 0 for entry in meta["output_token_logprobs"])


def stream_chunks(http: httpx.Client, **body) -> tuple[list[dict], str]:
    """The JSON chunks of a streamed /generate and the line that ended it."""
    with http.stream("POST", "/generate", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines[:-1]], lines[-1]


def test_stream_sends_cumulative_chunks_then_done(http):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True, "rid": "stream-1"}
    plain = generate(http, **body)
    chunks, last = stream_chunks(http, **body)
    assert last == "[DONE]" and len(chunks) >= 2  # one per step: the answer is not one chunk at the end
    assert chunks[-1]["output_ids"] == plain["output_ids"] and chunks[-1]["text"] == plain["text"]
    final_meta = chunks[-1]["meta_info"]
    assert final_meta["finish_reason"] == plain["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    streamed, expected = final_meta["output_token_logprobs"], plain["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in streamed] == [e[1] for e in expected]
    assert [e[0] for e in streamed] == pytest.approx([e[0] for e in expected], abs=1e-4)
    for earlier, later in zip(chunks, chunks[1:], strict=False):  # cumulative: each chunk extends the one before
        assert earlier["meta_info"]["finish_reason"] is None and earlier["meta_info"]["id"] == "stream-1"
        assert later["output_ids"][:len(earlier["output_ids"])] == earlier["output_ids"]
        assert len(earlier["meta_info"]["output_token_logprobs"]) == len(earlier["output_ids"])
    batch, last = stream_chunks(http, input_ids=[[5, 6], [7]], sampling_params={"max_new_tokens": 3})
    finished = {c["index"]: c for c in batch if c["meta_info"]["finish_reason"] is not None}
    assert last == "[DONE]" and sorted(finished) == [0, 1]
    assert all(len(c["output_ids"]) == 3 for c in finished.values())


def test_no_logprobs_unless_asked(http):
    out = generate(http, input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
    assert set(out["meta_info"]) == META_KEYS


def test_batch_and_n_return_indexed_lists(http):
    batch = generate(http, input_ids=[[5, 6], [7, 8, 9]], sampling_params={"max_new_tokens": 3}, rid=["a", "b"])
    assert [o["index"] for o in batch] == [0, 1]
    assert [o["meta_info"]["id"] for o in batch] == ["a", "b"]
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [2, 3]
    both = generate(http, input_ids=[[5, 6], [7, 8, 9]], sampling_params={"max_new_tokens": 3, "n": 2})
    assert [o["index"] for o in both] == [0, 1, 2, 3]
    assert [o["meta_info"]["prompt_tokens"] for o in both] == [2, 2, 3, 3]
    single_n = generate(http, input_ids=[5, 6], sampling_params={"max_new_tokens": 3, "n": 3}, rid="s")
    assert [(o["index"], o["meta_info"]["id"]) for o in single_n] == [(0, "s_0"), (1, "s_1"), (2, "s_2")]
    assert all(len(o["output_ids"]) == 3 for o in single_n)


def test_text_input_and_output_text(http, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = generate(http, text="12+34=", sampling_params={"max_new_tokens": 5, "temperature": 0})
    assert out["meta_info"]["prompt_tokens"] == len(tokenizer("12+34=")["input_ids"])
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_logprobs_match_transformers_at_temperature(http, hf_model):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]  # one batch, left-padded
    outs = generate(http, input_ids=prompts, return_logprob=True,
                    sampling_params={"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True})
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out["output_ids"]
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        got = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_input_token_logprobs_are_the_models_own_forward(http, hf_model):
    """A teacher's prefill-only call (slime's on-policy distillation): max_new_tokens 0, return_logprob and
    logprob_start_len give SGLang's input_token_logprobs, [logprob, token, null] per input token from the start
    (null for the first), log_softmax(logits / T) of the model's own forward; nothing is generated."""
    tokens = [5, 6, 7, 8, 9, 10, 11]
    out = generate(http, input_ids=tokens, return_logprob=True, logprob_start_len=0,
                   sampling_params={"max_new_tokens": 0, "temperature": 0.8})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == tokens and entries[0][0] is None and all(e[2] is None for e in entries)
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([tokens])).logits[0, :-1]
    expected = torch.log_softmax(logits / 0.8, dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]), expected, atol=1e-5, rtol=0)
    # from position 4 on, batched with a prompt that generates (its input scored too, then it generates)
    both = generate(http, input_ids=[tokens, [5, 6]], return_logprob=True, logprob_start_len=[4, 1],
                    sampling_params=[{"max_new_tokens": 0, "temperature": 0.8}, {"max_new_tokens": 2}])
    assert [e[1] for e in both[0]["meta_info"]["input_token_logprobs"]] == tokens[4:]
    torch.testing.assert_close(torch.tensor([e[0] for e in both[0]["meta_info"]["input_token_logprobs"]]),
                               expected[3:], atol=1e-5, rtol=0)
    assert len(both[1]["output_ids"]) == 2 and len(both[1]["meta_info"]["input_token_logprobs"]) == 1


def test_greedy_is_deterministic_and_argmax(http, hf_model):
    body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    first, second = generate(http, **body), generate(http, **body)
    assert first["output_ids"] == second["output_ids"]
    tokens = first["output_ids"]
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([[7, 8, 9] + tokens])).logits[0, 2:-1]
    assert logits.argmax(-1).tolist() == tokens
    raw = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]  # T=0 -> raw logits
    torch.testing.assert_close(torch.tensor([e[0] for e in first["meta_info"]["output_token_logprobs"]]), raw,
                               atol=1e-4, rtol=0)


def test_sampling_seed_reproduces(http):
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 8, "sampling_seed": 7}}
    assert generate(http, **body)["output_ids"] == generate(http, **body)["output_ids"]


def test_max_new_tokens_gives_length(http):
    out = generate(http, input_ids=[5], sampling_params={"max_new_tokens": 6, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == 6


def test_eos_stops_with_matched_eos(http):
    # The tiny model's eos row is zero, so eos is drawn by sampling (p ~ 1/80 per step), never greedily.
    outs = generate(http, input_ids=[[5, 6]] * 24, sampling_params=[
        {"max_new_tokens": 60, "sampling_seed": seed} for seed in range(24)])
    stopped = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped, "no sample drew eos"
    for out in outs:
        if out in stopped:
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
            assert out["output_ids"][-1] == EOS_ID and EOS_ID not in out["output_ids"][:-1]
        else:
            # length is checked first, as in SGLang: eos as the 60th token still reads "length"
            assert EOS_ID not in out["output_ids"][:-1] and out["meta_info"]["finish_reason"]["length"] == 60
    seed = outs.index(stopped[0])
    params = {"max_new_tokens": 60, "sampling_seed": seed}
    alone = generate(http, input_ids=[5, 6], sampling_params=params)
    ignoring = generate(http, input_ids=[5, 6], sampling_params={**params, "ignore_eos": True})
    assert alone["output_ids"] == stopped[0]["output_ids"]
    assert ignoring["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    assert ignoring["output_ids"][: len(alone["output_ids"])] == alone["output_ids"]


def _seeded_free_run(http: httpx.Client) -> tuple[dict, int]:
    """A seeded sample with a token at `cut` not seen before it and no special tokens up to it (1 char each)."""
    for seed in range(50):
        body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 12, "sampling_seed": seed,
                                                            "ignore_eos": True}}
        tokens = generate(http, **body)["output_ids"]
        cut = next((i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i]), None)
        if cut is not None and min(tokens[: cut + 1]) >= 4:
            return body, cut
    raise AssertionError("no usable seeded sample")


def test_stop_token_ids_and_stop_strings(http):
    body, cut = _seeded_free_run(http)
    free = generate(http, **body)
    tokens, text = free["output_ids"], free["text"]
    params = body["sampling_params"]
    stopped = generate(http, **{**body, "sampling_params": {**params, "stop_token_ids": [tokens[cut]]}})
    assert stopped["output_ids"] == tokens[: cut + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": tokens[cut]}
    stop_str = text[cut]  # one character per token
    by_str = generate(http, **{**body, "sampling_params": {**params, "stop": [stop_str]}})
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert by_str["text"] == text[:cut] and by_str["output_ids"] == tokens[: cut + 1]
    kept = generate(http, **{**body, "sampling_params": {**params, "stop": stop_str, "no_stop_trim": True}})
    assert kept["text"] == text[: cut + 1]


@pytest.mark.parametrize("body, fragment", [
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "foo_bar": 1}}, "foo_bar"),
    ({"input_ids": [5], "text": "1+1="}, "exactly one of text and input_ids"),
    ({"sampling_params": {}}, "exactly one of text and input_ids"),
    ({"input_ids": [5, 80]}, "token id 80 out of range"),
    ({"input_ids": [5] * 128}, "context length (128 tokens)"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [5], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [5], "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    ({"input_ids": [5], "sampling_params": {"n": 200_000}}, "n must be in [1, 128], got 200000"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 10**9}}, "max_new_tokens 1000000000 is more than"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 1e300}}, "is more than the model's context length"),
    ({"input_ids": [[5]] * 40, "sampling_params": {"n": 128}}, "more than 4096 requests"),
    ({"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len must be an integer"),
    ({"text": "1+1=", "image_data": ["data:image/png;base64,iVBORw0KGgo="]}, "model is a text model"),
])
def test_bad_requests_get_400(http, body, fragment):
    reply = http.post("/generate", json=body)
    assert reply.status_code == 400
    assert fragment in reply.json()["error"]["message"]


@pytest.mark.parametrize("content, status, fragment", [
    (b'{"input_ids": [5], "sampling_params": {"temperature": NaN}}', 400, "temperature must be a finite number"),
    (b'{"input_ids": [5], "sampling_params": {"max_new_tokens": Infinity}}', 400, "must be a finite number"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    (b'{"text": "' + b"1" * (17 << 20) + b'"}', 413, "request body over 16777216 bytes"),
])
def test_hostile_bodies_are_refused_and_health_answers(http, content, status, fragment):
    reply = http.post("/generate", content=content, headers={"content-type": "application/json"})
    assert reply.status_code == status and fragment in reply.json()["error"]["message"], reply.text[:500]
    assert http.get("/health_generate", timeout=30).status_code == 200


def test_unknown_top_level_fields_are_ignored(http):
    out = generate(http, input_ids=[5], sampling_params={"max_new_tokens": 1}, my_field="x", lora_path=None,
                   return_text_in_logprobs=False, logprob_start_len=-1)
    assert len(out["output_ids"]) == 1


def _long_batch(http: httpx.Client, size: int) -> list[dict]:
    return generate(http, input_ids=[[5, 6]] * size,
                    sampling_params={"max_new_tokens": 120, "ignore_eos": True, "temperature": 1.0})


def _wait_until(http: httpx.Client, key: str, timeout_s: float = 10.0) -> None:
    """Until /server_info counts some `key` requests (num_running_reqs, num_waiting_reqs)."""
    deadline = time.monotonic() + timeout_s
    while http.get("/server_info").json()["internal_states"][0][key] == 0:
        assert time.monotonic() < deadline, f"{key} stayed 0"
        time.sleep(0.01)


def test_pause_abort_finishes_inflight_requests_as_abort(http):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_long_batch, http, 192)  # three batches of 64, about a second of work
        _wait_until(http, "num_running_reqs")
        assert http.post("/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"
        try:
            outs = pending.result(timeout=30)
        finally:
            http.post("/continue_generation", json={})
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    assert all(r["type"] in ("abort", "length") for r in reasons)
    aborted = [o for o, r in zip(outs, reasons, strict=True) if r["type"] == "abort"]
    assert any(0 < len(o["output_ids"]) < 120 for o in aborted), "no request was aborted mid-generation"
    assert generate(http, input_ids=[5], sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_pause_in_place_then_continue_finishes(http):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(_long_batch, http, 128)  # two batches of 64, about a second of work
        _wait_until(http, "num_running_reqs")
        http.post("/pause_generation", json={"mode": "in_place"}).raise_for_status()
        try:
            parked = http.get("/server_info").json()["internal_states"][0]
            queued = pool.submit(generate, http, input_ids=[5], sampling_params={"max_new_tokens": 2})
            time.sleep(0.5)
            assert not running.done() and not queued.done()  # both wait while paused
        finally:
            http.post("/continue_generation", json={}).raise_for_status()
        outs = running.result(timeout=30)
        assert queued.result(timeout=30)["meta_info"]["completion_tokens"] == 2
    assert parked["paused"] and parked["num_running_reqs"] == 64  # the batch was parked mid-generation
    assert len(outs) == 128
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 120} for o in outs)


def test_abort_request_by_rid_while_paused(http):
    http.post("/pause_generation", json={"mode": "in_place"}).raise_for_status()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(generate, http, input_ids=[5], rid="to-abort",
                                  sampling_params={"max_new_tokens": 4, "n": 2})
            _wait_until(http, "num_waiting_reqs")
            http.post("/abort_request", json={"rid": "to-abort"}).raise_for_status()
            outs = pending.result(timeout=10)
    finally:
        http.post("/continue_generation", json={})
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert all(o["output_ids"] == [] for o in outs)


def test_weight_update_waits_for_the_running_batch(http, tiny_model_dir):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_long_batch, http, 64)
        _wait_until(http, "num_running_reqs")
        reply = http.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir),  # same weights
                                                              "weight_version": "reloaded"})
        outs = running.result(timeout=30)
    try:
        assert reply.json()["success"] is True, reply.text
        # each request records the version at its finish: the whole batch ran to its length on the old weights, so
        # the update waited for it (neither aborted nor paused and resumed under "reloaded"); the clients' own clocks
        # cannot tell, since both replies leave the engine within a millisecond and either thread may read first
        assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 120} for o in outs)
        assert {o["meta_info"]["weight_version"] for o in outs} == {"default"}
        assert http.get("/model_info").json()["weight_version"] == "reloaded"
    finally:
        http.post("/update_weight_version", json={"new_version": "default"})


def test_model_and_server_info(http, tiny_model_dir):
    info = http.get("/model_info").json()
    assert info["model_path"] == str(Path(tiny_model_dir).resolve()) == info["tokenizer_path"]
    assert info["is_generation"] is True and info["preferred_sampling_params"] is None
    assert (info["weight_version"], info["model_type"], info["architectures"]) == (
        "default", "qwen3", ["Qwen3ForCausalLM"])
    assert http.get("/get_model_info").json() == info
    server = http.get("/server_info").json()
    assert (server["tp_size"], server["dp_size"], server["max_context_length"]) == (1, 1, 128)
    assert server["max_batch_size"] == 64 and "version" in server
    assert http.get("/get_server_info").status_code == 200


def test_health_and_flush_cache(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert http.post("/flush_cache").status_code == 200


def test_weights_by_name_and_version_update(http, hf_model):
    weights = http.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 5}).json()
    assert weights == pytest.approx(hf_model.model.norm.weight[:5].tolist())
    reply = http.post("/update_weight_version", json={"new_version": "v-test"}).json()
    assert reply == {"success": True, "message": "Weight version updated to v-test", "new_version": "v-test"}
    try:
        assert generate(http, input_ids=[5], sampling_params={"max_new_tokens": 1})["meta_info"][
            "weight_version"] == "v-test"
    finally:
        http.post("/update_weight_version", json={"new_version": "default"})
