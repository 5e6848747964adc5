"""Step and micro-batch schedules: fixed micro-batches, first-fit token packing, trailing samples dropped."""

from __future__ import annotations

from services.trainer.batching.schedule import assign_to_ranks, dp_schedule, first_fit, halve, split_to, step_schedule


def test_fixed_micro_batches_and_trailing_samples_dropped():
    assert step_schedule([5] * 10, global_batch_size=4, micro_batch_size=3) == [[[0, 1, 2], [3]], [[4, 5, 6], [7]]]
    assert step_schedule([5] * 4, global_batch_size=None, micro_batch_size=2) == [[[0, 1], [2, 3]]]
    assert step_schedule([5] * 3, global_batch_size=4, micro_batch_size=1) == []
    assert step_schedule([], global_batch_size=None) == []


def test_first_fit_packs_by_token_count_in_order():
    # budget 10: 6 opens bin 0; 5 opens bin 1; 4 fits bin 0 (10); 3 fits bin 1 (8); 2 fits bin 1 (10)
    assert first_fit([6, 5, 4, 3, 2], range(5), max_tokens=10) == [[0, 2], [1, 3, 4]]


def test_a_sample_longer_than_the_budget_sits_alone():
    assert first_fit([3, 12, 3], range(3), max_tokens=10) == [[0, 2], [1]]


def test_dynamic_schedule_packs_each_step_on_its_own():
    lengths = [4, 4, 4, 4, 9, 1]
    steps = step_schedule(lengths, global_batch_size=3, micro_batch_size=1, max_tokens_per_gpu=8)
    assert steps == [[[0, 1], [2]], [[3, 5], [4]]]  # packed within a step; samples never cross steps


def test_halve_balances_tokens_and_keeps_order():
    # longest first to the lighter half: 7 -> a; 4 -> b; 3 -> b (7 vs 4); 1 -> a (7 vs 7, first)
    assert halve([7, 1, 4, 3], [0, 1, 2, 3]) == ([0, 1], [2, 3])


def test_split_to_halves_the_heaviest_then_fills_with_empty_micro_batches():
    # [0, 1] holds 9 tokens, [2, 3] 4: the heaviest splits first
    assert split_to([6, 3, 2, 2], [[0, 1], [2, 3]], 3) == [[0], [1], [2, 3]]
    assert split_to([6, 3], [[0, 1]], 4) == [[0], [1], [], []]  # nothing left to split


def test_micro_batches_are_dealt_to_ranks_by_tokens_in_equal_numbers():
    # 8, 7, 4, 1 tokens: 8 -> rank 0; 7 -> rank 1; 4 -> rank 1 (7 < 8); rank 1 is full, 1 -> rank 0: 9 and 11 tokens
    assert assign_to_ranks([8, 7, 4, 1], [[0], [1], [2], [3]], 2) == [[[0], [3]], [[1], [2]]]
    assert assign_to_ranks([5, 5, 5], [[0], [1], [2]], 2) == [[[0], [2]], [[1]]]  # three over two: one more first


def test_dp_schedule_packs_first_and_deals_second():
    # budget 8, first fit: [0, 4] = 7 + 1, [1, 3] = 5 + 3, [2] = 4; three micro-batches round up to four: [0, 4]
    # (8 tokens, first of the two heaviest) halves into [0] and [4]; then 8 -> rank 0, 7 -> rank 1, 4 -> rank 1,
    # 1 -> rank 0: every rank runs two micro-batches, 9 and 11 tokens
    lengths = [7, 5, 4, 3, 1]
    assert dp_schedule(lengths, range(5), dp_size=2, max_tokens_per_gpu=8) == [[[1, 3], [4]], [[0], [2]]]
    # the contiguous split it replaces: rank 0 would run [7, 5] and rank 1 [4, 3, 1] tokens, 12 against 8
    assert dp_schedule(lengths, range(5), dp_size=1, max_tokens_per_gpu=8) == [[[0, 4], [1, 3], [2]]]


def test_dp_schedule_on_fixed_micro_batches_and_short_steps():
    # a long tail at the front, two micro-batches of two: longest first into the lightest, [0, 2] and [1, 3] hold
    # 10 tokens each (consecutive chunks would give one rank 18 tokens and the other 2)
    assert dp_schedule([9, 9, 1, 1], range(4), dp_size=2, micro_batch_size=2) == [[[0, 2]], [[1, 3]]]
    assert dp_schedule([9, 9, 1, 1], range(4), dp_size=2, micro_batch_size=1) == [[[0], [2]], [[1], [3]]]
    # three samples over two ranks: two micro-batches (never more than samples), [0, 2] and [1]
    assert dp_schedule([2, 2, 2], range(3), dp_size=2, micro_batch_size=4) == [[[0, 2]], [[1]]]
