"""GPTModel's inputs for a micro-batch under sequence parallelism: each row lengthened with pad tokens to a multiple
of the TP size (packed: as one more sequence, its positions from 0), the pad tokens marked for the MoE routers."""

from __future__ import annotations

import torch

from services.common.samples import Sample
from services.trainer.backends.megatron.model import gpt_inputs, sequence_length
from services.trainer.batching.batch import build_rollout_batch

PAD = 9


def micro_batch():
    """Two samples of 5 and 4 tokens: 9 packed, a 2 × 5 rectangle."""
    samples = [Sample(tokens=[1, 2, 3, 4, 5], response_length=2), Sample(tokens=[6, 7, 8, 1], response_length=1)]
    return build_rollout_batch(samples, pad_token_id=PAD)


def test_a_packed_row_is_padded_to_a_multiple_of_the_tp_size_as_one_more_sequence():
    mb = micro_batch()
    assert sequence_length(mb, packed=True) == 9
    inputs = gpt_inputs(mb, packed=True, use_te=False, pad_to=4, pad_token_id=PAD, padding_mask=True)
    assert inputs["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 1, PAD, PAD, PAD]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    params = inputs["packed_seq_params"]
    assert params.cu_seqlens_q.tolist() == [0, 5, 9, 12] and params.max_seqlen_q == 5
    assert inputs["padding_mask"].tolist() == [[False] * 9 + [True] * 3]


def test_a_padded_rectangle_is_lengthened_under_its_causal_mask():
    mb = micro_batch()
    inputs = gpt_inputs(mb, packed=False, use_te=False, pad_to=2, pad_token_id=PAD, padding_mask=True)
    assert inputs["input_ids"].tolist() == [[1, 2, 3, 4, 5, PAD], [6, 7, 8, 1, PAD, PAD]]
    assert inputs["position_ids"].tolist() == [list(range(6))] * 2
    assert torch.equal(inputs["attention_mask"][0, 0], torch.ones(6, 6, dtype=torch.bool).triu(1))
    assert inputs["padding_mask"].tolist() == [[False] * 5 + [True], [False] * 4 + [True] * 2]


def test_without_sequence_parallelism_the_inputs_are_the_micro_batchs_own():
    mb = micro_batch()
    packed = gpt_inputs(mb, packed=True, use_te=False)
    assert packed["input_ids"].shape == (1, 9) and "padding_mask" not in packed
    assert packed["packed_seq_params"].cu_seqlens_q.tolist() == [0, 5, 9]
    assert gpt_inputs(mb, packed=False, use_te=False, pad_to=5)["input_ids"].shape == (2, 5)
