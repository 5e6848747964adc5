"""A reward function with slime's signature that lets a test pace a job: a sample is scored only once the gate file
(env PHYSARUM_TEST_REWARD_GATE) holds a number >= its prompt index, so each rollout ends when the test allows it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


async def gated_exact_match(args, sample) -> float:
    gate = Path(os.environ["PHYSARUM_TEST_REWARD_GATE"])
    while sample.group_index > int(gate.read_text().strip() or -1):
        await asyncio.sleep(0.05)
    return float(sample.response.strip() == sample.label.strip())
