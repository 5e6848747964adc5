"""slime.rollout.base_types: what a rollout function returns (RolloutFnTrainOutput, RolloutFnEvalOutput) and
slime's call_rollout_fn, which wraps a legacy function's plain return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] = None


def call_rollout_fn(fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    return output


__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput", "call_rollout_fn"]
