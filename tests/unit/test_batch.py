"""Samples -> padded RolloutBatch: padding, response alignment, defaults and validation."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.batching.batch import build_rollout_batch


def _samples() -> list[Sample]:
    return [
        Sample(tokens=[5, 6, 7, 8, 9], response_length=2, reward=1.0, loss_mask=[1, 0], rollout_log_probs=[-1, -2]),
        Sample(tokens=[5, 6, 7], response_length=2, reward=0.5, rollout_log_probs=[-3, -4]),
        Sample(tokens=[4, 5], response_length=0, reward=-1.0),
    ]


def test_padding_and_response_alignment():
    batch = build_rollout_batch(_samples(), pad_token_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0], [4, 5, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert batch.prompt_lengths.tolist() == [3, 1, 2] and batch.response_lengths.tolist() == [2, 2, 0]
    assert batch.response_tokens.tolist() == [[8, 9], [6, 7], [0, 0]]
    assert batch.loss_masks.tolist() == [[1, 0], [1, 1], [0, 0]]  # empty loss_mask: train on every token
    assert batch.rollout_log_probs.tolist() == [[-1, -2], [-3, -4], [0, 0]]
    assert batch.rewards.tolist() == [1.0, 0.5, -1.0] and batch.advantages.abs().sum().item() == 0.0
    # response token t is predicted by the logits at prompt_length + t - 1
    assert batch.logit_positions().tolist() == [[2, 3], [0, 1], [1, 2]]


def test_rollout_log_probs_are_dropped_unless_every_sample_has_them():
    samples = _samples()
    samples[1].rollout_log_probs = []
    assert build_rollout_batch(samples).rollout_log_probs is None


def test_select_trims_padding_to_the_rows():
    sub = build_rollout_batch(_samples()).select(1, 3)
    assert sub.tokens.tolist() == [[5, 6, 7], [4, 5, 0]]
    assert sub.loss_masks.tolist() == [[1, 1], [0, 0]] and sub.logit_positions().tolist() == [[0, 1], [1, 2]]


def test_take_picks_rows_in_order_with_the_computed_tensors():
    batch = build_rollout_batch(_samples())
    batch = batch.with_(log_probs=torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [0.0, 0.0]]))
    sub = batch.take([2, 0])
    assert sub.tokens.tolist() == [[4, 5, 0, 0, 0], [5, 6, 7, 8, 9]]
    assert sub.log_probs.tolist() == [[0.0, 0.0], [-1.0, -2.0]] and sub.values is None
    assert sub.rewards.tolist() == [-1.0, 1.0] and batch.total_lengths == [5, 3, 2]
    with pytest.raises(ValueError, match=r"values shape \(2, 3\) != loss_masks \(3, 2\)"):
        batch.with_(values=torch.zeros(2, 3))


def test_reward_key_picks_the_score_a_reward_function_returned():
    samples = _samples()
    samples[0].reward_scores = {"acc": 0.0, "score": -1.0}
    assert build_rollout_batch(samples, reward_key="score").rewards.tolist() == [-1.0, 0.5, -1.0]
    assert build_rollout_batch(samples).rewards.tolist() == [1.0, 0.5, -1.0]  # no key: sample.reward


@pytest.mark.parametrize("sample, message", [
    (Sample(tokens=[1, 2], response_length=2), "sample 0: response_length 2 must be in"),
    (Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1]), "sample 0: loss_mask has 1 entries"),
    (Sample(tokens=[1, 2, 3], response_length=1, rollout_log_probs=[-1, -2]), "sample 0: rollout_log_probs has 2"),
])
def test_bad_samples_are_named(sample, message):
    with pytest.raises(InvalidArgument, match=message):
        build_rollout_batch([sample])


def test_empty_rollout_is_rejected():
    with pytest.raises(InvalidArgument, match="no samples"):
        build_rollout_batch([])
