"""bench/varlen_attention.py: both layouts hold the long tail's samples, and the clock follows the thread count (CPU
time on one thread, wall time on more, where CPU time would add up the threads' work)."""

from __future__ import annotations

import itertools

import pytest
import torch

from bench import varlen_attention
from bench.trainer_throughput import SHAPES, packed_budget


def test_packed_and_padded_micro_batches_hold_the_same_samples():
    packed, padded = varlen_attention._micro_batches(packed=True), varlen_attention._micro_batches(packed=False)
    assert sorted(itertools.chain(*packed)) == sorted(itertools.chain(*padded))
    assert packed_budget(SHAPES["cpu"]) == 4 * (16 + 256)  # micro-batches of 4 samples of prompt 16, response 256
    assert all(sum(row) <= packed_budget(SHAPES["cpu"]) for row in packed)
    assert all(len(mb) <= SHAPES["cpu"]["micro_batch_size"] for mb in padded)


@pytest.mark.parametrize("threads, clock", [(1, "process_time"), (2, "perf_counter")])
def test_the_clock_follows_the_thread_count(threads, clock, monkeypatch):
    ticks = itertools.count(step=0.5)  # every step reads 0.5 s on the clock the bench should use
    monkeypatch.setattr(varlen_attention.time, clock, lambda: next(ticks))
    before = torch.get_num_threads()
    try:
        result = varlen_attention.main(["--rounds", "1", "--threads", str(threads)])
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert result["threads"] == threads
    assert [result[f"{name}_ms"] for name in ("tiles", "recorded_tiles", "per_sequence", "padded")] == [500.0] * 4
    assert result["padded_over_tiles"] == 1.0
    for key in result:
        assert f'"{key}"' in varlen_attention.__doc__, key
