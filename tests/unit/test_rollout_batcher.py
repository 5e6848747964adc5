"""Coalescing of concurrent calls (generation/batcher.py) and the reward service scoring the groups that finish
together in one call (scoring.ServiceScorer), each group getting back its own samples' results."""

from __future__ import annotations

import asyncio

import pytest

from services.common.samples import Sample
from services.rollout.generation.batcher import Batcher
from services.rollout.generation.scoring import ServiceScorer
from tests.unit.rollout_fakes import FakeReward, rollout_config


def test_items_queued_while_a_flush_runs_go_out_together_within_the_size_limit():
    flushes: list[list[int]] = []
    gate = asyncio.Event()

    async def flush(items: list[int]) -> list[int]:
        flushes.append(items)
        await gate.wait()
        return [10 * i for i in items]

    async def main() -> list[int]:
        batcher = Batcher(flush, max_items=5, size=lambda item: 2 if item >= 100 else 1)
        first = asyncio.create_task(batcher.submit(0))
        await asyncio.sleep(0)  # the first flush starts with one item
        rest = [asyncio.create_task(batcher.submit(i)) for i in (1, 2, 100, 3, 4)]
        await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(first, *rest)

    assert asyncio.run(main()) == [0, 10, 20, 1000, 30, 40]
    assert flushes == [[0], [1, 2, 100, 3], [4]]  # 1 + 1 + 2 + 1 = 5 fits; 4 waits for the next flush


def test_a_failing_flush_fails_its_batch_only_and_a_cancelled_caller_leaves_the_others():
    calls = []

    async def flush(items: list[str]) -> list[str]:
        calls.append(items)
        await asyncio.sleep(0)
        if "bad" in items:
            raise ValueError("scorer down")
        return [item.upper() for item in items]

    async def main():
        batcher = Batcher(flush, max_items=2)
        bad = asyncio.create_task(batcher.submit("bad"))
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(batcher.submit("gone"))
        kept = asyncio.create_task(batcher.submit("ok"))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(ValueError, match="scorer down"):
            await bad
        return await kept, batcher.running

    assert asyncio.run(main()) == ("OK", None)
    assert calls == [["bad"], ["ok"]]  # the cancelled caller's item was never sent


def test_service_scorer_scores_concurrent_groups_in_one_call_and_hands_each_its_own_results():
    reward = FakeReward()
    scorer = ServiceScorer(reward, rollout_config(rm_type="exact_match", reward_timeout_s=7.0))
    groups = [[Sample(response="a" * (g + j)) for j in range(2)] for g in range(1, 6)]

    async def main():
        return await asyncio.gather(*(scorer.score(group) for group in groups))

    results = asyncio.run(main())
    assert [[r.reward for r in group] for group in results] == [[g, g + 1.0] for g in range(1, 6)]
    assert len(reward.calls) == 1  # all five were queued before the first flush started
    assert reward.calls[0]["rm_type"] == "exact_match" and reward.calls[0]["timeout_s"] == 7.0
    assert reward.calls[0]["args"] == {"k": 1}
