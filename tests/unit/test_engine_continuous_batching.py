"""The CPU engine's continuous batching: a request that arrives while a batch decodes joins it at a step boundary
(the running rows are prefilled again with their tokens so far), and what each row generates is what it would
generate alone."""

from __future__ import annotations

import threading
import time

import pytest

from services.engine.generation import Engine, Request, SamplingParams, load_model

PROMPTS = ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16])


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    model, tokenizer = load_model(str(tiny_model_dir))
    # 20 ms a step: a request sent after the first steps arrives while the batch still decodes
    eng = Engine(model, tokenizer, max_batch_size=8, per_token_delay_s=0.02).start()
    yield eng
    eng.stop()


def greedy(prompt: list[int], rid: str, max_new_tokens: int, finished: threading.Event | None = None) -> Request:
    return Request(rid=rid, input_ids=list(prompt), params=SamplingParams(max_new_tokens=max_new_tokens,
                                                                          temperature=0.0, ignore_eos=True),
                   on_finish=(lambda r: finished.set()) if finished else (lambda r: None))


def run_alone(engine: Engine, prompt: list[int], max_new_tokens: int) -> list[int]:
    finished = threading.Event()
    request = greedy(prompt, "alone", max_new_tokens, finished)
    engine.submit([request])
    assert finished.wait(60)
    return request.output_ids


def test_a_late_request_joins_the_running_batch_and_each_row_generates_what_it_would_alone(engine):
    alone = [run_alone(engine, prompt, n) for prompt, n in zip(PROMPTS, (30, 6, 6), strict=True)]
    events = [threading.Event() for _ in PROMPTS]
    first = greedy(PROMPTS[0], "first", 30, events[0])
    engine.submit([first])
    deadline = time.monotonic() + 30
    while len(first.output_ids) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert 3 <= len(first.output_ids) < 30, "the first request must still be decoding when the others arrive"
    late = [greedy(prompt, f"late-{i}", 6, event) for i, (prompt, event) in
            enumerate(zip(PROMPTS[1:], events[1:], strict=True))]
    engine.submit(late)
    assert events[1].wait(30) and events[2].wait(30)
    # they joined: done while the first request (24+ steps left when they came) still runs
    assert not first.finished
    assert engine.num_requests() == (1, 0)
    assert events[0].wait(60)
    assert [first.output_ids, *(r.output_ids for r in late)] == alone
    assert all(len(r.output_logprobs) == len(r.output_ids) for r in (first, *late))
    assert first.finish_reason == {"type": "length", "length": 30}
