"""Step and micro-batch schedules: fixed micro-batches, first-fit token packing, trailing samples dropped."""

from __future__ import annotations

from services.trainer.backends.schedule import first_fit, step_schedule


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
