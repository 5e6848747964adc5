"""The CPU engine's per-row sampling and SGLang sampling_params parsing, against hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.errors import InvalidArgument
from services.engine.generation import Request, SamplingParams, sample_next
from services.engine.protocol import parse_sampling_params

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()  # softmax(LOGITS) == PROBS at temperature 1


def draws(params: SamplingParams, logits: torch.Tensor = LOGITS, num: int = 300, **request) -> set[int]:
    rng = torch.Generator().manual_seed(0)
    req = Request(rid="r", input_ids=request.get("input_ids", [0]), params=params,
                  output_ids=request.get("output_ids", []))
    return {sample_next(logits, req, rng, frozenset({3}))[0] for _ in range(num)}


def test_logprob_is_log_softmax_at_temperature_whatever_the_filters():
    req = Request(rid="r", input_ids=[0], params=SamplingParams(temperature=0.5, top_k=2, top_p=0.6))
    token, logprob = sample_next(LOGITS, req, torch.Generator().manual_seed(1), frozenset())
    scaled = PROBS ** 2 / (PROBS ** 2).sum()  # softmax(log p / 0.5) = p^2 / sum p^2
    assert logprob == pytest.approx(math.log(scaled[token]), abs=1e-6)


def test_greedy_at_temperature_zero_reports_raw_logprob():
    token, logprob = sample_next(LOGITS, Request(rid="r", input_ids=[0], params=SamplingParams(temperature=0)),
                                 torch.Generator(), frozenset())
    assert (token, logprob) == (0, pytest.approx(math.log(0.5), abs=1e-6))


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(), {0, 1, 2, 3}),
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),        # mass before token: 0, 0.5, 0.8 > 0.7
    (SamplingParams(top_p=0.85), {0, 1, 2}),
    (SamplingParams(min_p=0.5), {0, 1}),        # keep p >= 0.25
    (SamplingParams(min_p=0.7), {0}),           # keep p >= 0.35
])
def test_filters_restrict_the_draws(params, allowed):
    assert draws(params) == allowed


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([1.0, 0.8, -5.0, -5.0])
    assert draws(SamplingParams(temperature=0), logits, num=1) == {0}
    assert draws(SamplingParams(temperature=0, repetition_penalty=2.0), logits, num=1, input_ids=[0]) == {1}
    assert draws(SamplingParams(temperature=0, frequency_penalty=0.15), logits, num=1, output_ids=[0, 0]) == {1}
    assert draws(SamplingParams(temperature=0, presence_penalty=0.15), logits, num=1, output_ids=[0, 0]) == {0}
    assert draws(SamplingParams(temperature=0, presence_penalty=0.25), logits, num=1, output_ids=[0, 0]) == {1}


def test_min_new_tokens_bans_eos_and_stop_tokens():
    logits = torch.tensor([0.0, 1.0, 0.5, 2.0])  # eos (3) is the argmax
    assert draws(SamplingParams(temperature=0, min_new_tokens=1), logits, num=1) == {1}
    assert draws(SamplingParams(temperature=0, min_new_tokens=1, stop_token_ids=frozenset({1})), logits,
                 num=1) == {2}
    assert draws(SamplingParams(temperature=0, min_new_tokens=1), logits, num=1, output_ids=[1]) == {3}


def test_parse_sampling_params_defaults_and_conversions():
    params, n = parse_sampling_params({"max_new_tokens": 8, "stop": "\n", "stop_token_ids": [2], "n": 3,
                                       "temperature": 0, "top_k": None, "spaces_between_special_tokens": False})
    assert n == 3
    assert params == SamplingParams(max_new_tokens=8, stop=("\n",), stop_token_ids=frozenset({2}), temperature=0.0)
    assert parse_sampling_params(None) == (SamplingParams(), 1)


@pytest.mark.parametrize("raw, fragment", [
    ({"foo": 1, "max_tokens": 2}, "unknown keys foo, max_tokens"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_k": 0}, "top_k must be -1 (disable), or at least 1"),
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"stop": [1]}, "stop must be a string or a list of strings"),
    ({"regex": "a+"}, "regex not supported"),
    ({"n": 0}, "n must be in [1, 128], got 0"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens must be in [0, max_new_tokens=2]"),
])
def test_parse_sampling_params_rejects_with_the_key_named(raw, fragment):
    with pytest.raises(InvalidArgument) as err:
        parse_sampling_params(raw)
    assert fragment in str(err.value)
