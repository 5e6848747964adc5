"""On-policy distillation's teacher call in the rollout service: the prefill-only /generate body it sends, how it
reads SGLang's input_token_logprobs, and its errors (a scripted teacher: httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.samples import Sample
from services.rollout.engine_calls.router_http import HttpxPoster
from services.rollout.generation import teacher

URL = "http://teacher.test/generate"


def scripted(handler) -> HttpxPoster:
    return HttpxPoster(httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def reply(tokens: list[int], start: int, logprob=lambda i: -0.1 * i) -> dict:
    entries = [[None if i == 0 else logprob(i), t, None] for i, t in enumerate(tokens)][start:]
    return {"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": entries}}


def test_the_teacher_scores_each_samples_response_tokens(monkeypatch):
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        return httpx.Response(200, json=reply(body["input_ids"], body["logprob_start_len"]))

    samples = [Sample(tokens=[3, 4, 5, 6, 7], response_length=3), Sample(tokens=[3, 4, 9], response_length=0)]
    asyncio.run(teacher.score_group_with_teacher(scripted(handler), URL, samples, temperature=0.7, what="t"))
    assert sent == [{"input_ids": [3, 4, 5, 6, 7], "return_logprob": True, "logprob_start_len": 2,
                     "sampling_params": {"temperature": 0.7, "max_new_tokens": 0, "skip_special_tokens": False}}]
    assert samples[0].teacher_log_probs == pytest.approx([-0.2, -0.3, -0.4])  # tokens 5, 6, 7
    assert samples[1].teacher_log_probs == []  # nothing to score, nothing sent


def test_a_teacher_that_scores_from_the_start_gives_the_last_response_length():
    """slime's own call sends logprob_start_len 0 and keeps the last response_length: a teacher that ignores the
    start position answers the same."""
    sample = Sample(tokens=[3, 4, 5, 6], response_length=2)
    whole = scripted(lambda r: httpx.Response(200, json=reply(sample.tokens, 0)))
    asyncio.run(teacher.score_with_teacher(whole, URL, sample, temperature=1.0, what="t"))
    assert sample.teacher_log_probs == pytest.approx([-0.2, -0.3])


@pytest.mark.parametrize("response, error, fragment", [
    (httpx.Response(400, text="bad vocab"), InvalidArgument, "rejected the request: HTTP 400"),
    (httpx.Response(200, json={"meta_info": {}}), FailedPrecondition, "no input_token_logprobs"),
    (httpx.Response(200, json=reply([3, 4, 8, 9], 2)), FailedPrecondition, "other tokens"),
    (httpx.Response(200, json=reply([3, 4, 5, 6], 2, logprob=lambda i: None)), FailedPrecondition, "not a finite"),
    (httpx.Response(503, text="restarting"), Unavailable, "no answer after 3 attempts; last: HTTP 503"),
])
def test_teacher_errors_name_the_teacher(monkeypatch, response, error, fragment):
    monkeypatch.setattr(teacher, "RETRY_DELAY_S", 0.0)
    sample = Sample(tokens=[3, 4, 5, 6], response_length=2)
    with pytest.raises(error, match=fragment) as err:
        asyncio.run(teacher.score_with_teacher(scripted(lambda r: response), URL, sample, temperature=1.0,
                                               what="rollout 0: prompt 1"))
    assert "rollout 0: prompt 1: teacher http://teacher.test/generate" in str(err.value)


def test_distillation_alone_gives_reward_zero():
    samples = [Sample(tokens=[1, 2], response_length=1, reward=1.0, reward_scores={"acc": 1.0}, reward_error="x")]
    teacher.distillation_only(samples)
    assert (samples[0].reward, samples[0].reward_scores, samples[0].reward_error) == (0.0, {}, "")
