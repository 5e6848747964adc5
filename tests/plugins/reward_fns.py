"""Reward functions with slime's custom_rm_path signature `async def f(args, sample)`, and broken ones."""

from __future__ import annotations

import asyncio

peak_active = 0  # the most `sleepy` calls running at once, for concurrency tests
_active = 0


async def scaled_match(args, sample) -> float:
    """args.scale if the response equals the label, else 0.0."""
    return args.scale * float(sample.response.strip() == sample.label.strip())


async def dapo_like(args, sample) -> dict:
    """A dict of scores like slime's dapo: score +1/-1, acc, and a non-numeric pred."""
    correct = sample.response.strip() == sample.label.strip()
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": sample.response.strip()}


async def boom(args, sample) -> float:
    raise ValueError(f"cannot score {sample.response!r}")


async def slow(args, sample) -> float:
    await asyncio.sleep(args.sleep_s)
    return 1.0


async def sleepy(args, sample) -> float:
    """Sleeps args.sleep_s and records how many calls overlap in `peak_active`."""
    global _active, peak_active
    _active += 1
    peak_active = max(peak_active, _active)
    try:
        await asyncio.sleep(args.sleep_s)
    finally:
        _active -= 1
    return float(sample.index)


async def not_a_number(args, sample) -> str:
    return "high"


async def args_echo(args, sample) -> float:
    """args.n + metadata["bonus"], checking both arrive as ints (as a user's `range(args.n)` needs)."""
    if not isinstance(args.n, int) or not isinstance(sample.metadata["bonus"], int):
        raise TypeError(f"expected ints, got {type(args.n).__name__} and {type(sample.metadata['bonus']).__name__}")
    return float(args.n + sample.metadata["bonus"])


def sync_reward(args, sample) -> float:
    return 1.0


async def one_param(sample) -> float:
    return 1.0
