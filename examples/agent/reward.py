"""The calculator agent's reward, in a module of its own: the reward service imports only this."""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


async def reward(args: Any, sample: Any) -> float:
    """1 when the last number of the model's final answer (the session's last assistant message) is the label."""
    numbers = _NUMBER.findall(sample.metadata.get("agent_final_content", ""))
    return float(bool(numbers) and numbers[-1] == str(sample.label).strip())
