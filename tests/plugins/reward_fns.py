"""Reward functions with slime's custom_rm_path signature `async def f(args, sample)`, and broken ones."""

from __future__ import annotations

import asyncio
import os
import time

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


async def timed(args, sample) -> dict:
    """Sleeps args.sleep_s; its start and end (wall clock, in the worker) let a test count overlapping calls."""
    start = time.time()
    await asyncio.sleep(args.sleep_s)
    return {"score": float(sample.index), "start": start, "end": time.time()}


# ----- hostile functions: each must fail only its own sample -----

async def exits(args, sample) -> float:
    raise SystemExit(3)


async def interrupts(args, sample) -> float:
    raise KeyboardInterrupt


async def blocking_sleep(args, sample) -> float:
    """Blocks its thread (time.sleep): an asyncio timeout alone could not stop it."""
    time.sleep(args.sleep_s)
    return 1.0


async def hog_memory(args, sample) -> float:
    """Allocates args.num_bytes at once."""
    block = bytearray(args.num_bytes)
    return float(len(block) > 0)


async def dies(args, sample) -> float:
    os._exit(7)


async def huge_error(args, sample) -> float:
    raise ValueError("x" * (10 << 20))
