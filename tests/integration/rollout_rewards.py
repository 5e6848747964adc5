"""A reward function with slime's signature for the rollout tests: known values, and one sample that fails."""

from __future__ import annotations


async def response_length_reward(args, sample) -> float:
    """reward = response_length / 100 + args.bonus; the third sample of every group fails to score."""
    if sample.index == 2:
        raise ValueError("sample 2 is never scored")
    return sample.response_length / 100 + args.bonus
