"""The CPU engine's batched draw of plain rows (temperature only) against per-row sampling's distribution and
log-probs; rows with filters or seeds still go through sample_next."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.generation import Request, SamplingParams, plain, sample_rows

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def request(**params) -> Request:
    return Request(rid="r", input_ids=[0], params=SamplingParams(**params))


def test_plain_rows_are_the_unfiltered_unseeded_ones():
    assert plain(request()) and plain(request(temperature=0)) and plain(request(temperature=0.5))
    for params in ({"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.1}, {"sampling_seed": 3}, {"repetition_penalty": 1.2},
                   {"presence_penalty": 0.5}, {"min_new_tokens": 1}):
        assert not plain(request(**params)), params


def test_batched_rows_report_log_softmax_at_their_temperature_and_greedy_takes_the_argmax():
    rows = [request(), request(temperature=0.5), request(temperature=0), request(top_k=1)]
    drawn = sample_rows(LOGITS.repeat(4, 1), rows, torch.Generator().manual_seed(0), frozenset())
    token, logprob = drawn[0]
    assert logprob == pytest.approx(math.log(PROBS[token]), abs=1e-6)
    token, logprob = drawn[1]
    assert logprob == pytest.approx(math.log((PROBS ** 2 / (PROBS ** 2).sum())[token]), abs=1e-6)
    assert drawn[2] == (0, pytest.approx(math.log(0.5), abs=1e-6))  # greedy in the batch
    assert drawn[3][0] == 0  # top_k=1: per-row path, greedy too


def test_batched_draws_follow_the_distribution():
    rng, rows = torch.Generator().manual_seed(0), [request() for _ in range(2000)]
    counts = torch.bincount(torch.tensor([t for t, _ in sample_rows(LOGITS.repeat(2000, 1), rows, rng,
                                                                    frozenset())]), minlength=4)
    assert torch.allclose(counts / 2000, PROBS, atol=0.04)


def test_never_drawn_tokens_are_not_drawn_but_the_others_keep_the_whole_vocabulary_s_log_probs():
    """A VLM's image placeholders (here tokens 0 and 2) are never drawn, greedy or sampled, batched or per row; a
    drawn token still reports log_softmax over every token, as the trainer recomputes it."""
    never = torch.tensor([0, 2])
    rows = [request(), request(temperature=0), request(top_k=3), request(temperature=0.5, top_p=0.9)] * 50
    drawn = sample_rows(LOGITS.repeat(len(rows), 1), rows, torch.Generator().manual_seed(0), frozenset(), never)
    assert {token for token, _ in drawn} == {1, 3}
    assert drawn[1] == (1, pytest.approx(math.log(0.3), abs=1e-6))  # greedy takes the likeliest drawable token
    for row, (token, logprob) in zip(rows, drawn, strict=True):
        scaled = PROBS ** (1 / row.params.temperature) if row.params.temperature > 0 else PROBS
        assert logprob == pytest.approx(math.log((scaled / scaled.sum())[token]), abs=1e-6)
