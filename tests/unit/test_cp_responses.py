"""slime's context-parallel layout of a response (`distributed/cp_responses.py`, under the compat package's
cp_utils): which of a response's log-prob positions each CP rank holds, against hand-derived chunks; at CP 1 (no
megatron process groups) slicing and gathering are the identity. The gather over a real CP group is in
tests/integration/test_megatron_context_parallel.py (slime's mis.py at CP 2 equals CP 1)."""

from __future__ import annotations

import torch

from services.trainer.distributed import cp_responses
from services.trainer.distributed.cp_responses import CPRank


def test_each_rank_holds_the_response_positions_of_its_two_chunks():
    # 12 tokens (prompt 4, response 8) in 2·CP = 4 chunks of 3: rank 0 chunks [0, 3) and [9, 12), rank 1 [3, 6) and
    # [6, 9); the response's logits sit at positions [3, 11): rank 0 holds 9, 10 (response tokens 6, 7), rank 1 3..8
    assert cp_responses.logit_ranges(12, 8, CPRank(0, 2)) == ((0, 0), (9, 11))
    assert cp_responses.logit_ranges(12, 8, CPRank(1, 2)) == ((3, 6), (6, 9))
    values = torch.arange(8.0)
    assert cp_responses.slice_response(values, 12, 8, CPRank(0, 2)).tolist() == [6.0, 7.0]
    assert cp_responses.slice_response(values, 12, 8, CPRank(1, 2)).tolist() == [0.0, 1, 2, 3, 4, 5]
    assert cp_responses.slice_response(list(range(8)), 12, 8, CPRank(0, 2)) == [6, 7]
    # CP 3: 6 chunks of 2; rank 0 [0, 2) and [10, 12), rank 1 [2, 4) and [8, 10), rank 2 [4, 6) and [6, 8)
    assert [cp_responses.slice_response(values, 12, 8, CPRank(r, 3)).tolist() for r in range(3)] == [
        [7.0], [0.0, 5, 6], [1.0, 2, 3, 4]]


def test_without_megatron_groups_a_response_stays_whole():
    assert cp_responses.current() == CPRank()
    values = torch.arange(5.0)
    assert cp_responses.slice_response(values, 9, 5, cp_responses.current()) is values
    assert cp_responses.gather_response(values, 9, 5, cp_responses.current()) is values
