"""slime.rollout.rm_hub: slime's rule-based reward models, served by the Reward service's own implementations."""

from __future__ import annotations

import asyncio
from typing import Any

from services.reward import verifiers
from services.reward.rm.math import deepscaler_reward as get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.math_utils import extract_answer as extract_boxed_answer
from slime.rollout.rm_hub.math_utils import grade_answer_verl
from slime.utils.misc import load_function


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """slime's order: the sample's custom_rm_path, the job's, then metadata.rm_type or the job's rm_type."""
    path = getattr(sample, "custom_rm_path", None) or getattr(args, "custom_rm_path", None)
    if path:
        return await load_function(path)(args, sample, **kwargs)
    return await verifiers.score_builtin(sample, getattr(args, "rm_type", None) or "", vars(args))


async def batched_async_rm(args: Any, samples: list[Any], **kwargs: Any) -> list[Any]:
    if getattr(args, "custom_rm_path", None):
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))


__all__ = ["async_rm", "batched_async_rm", "extract_boxed_answer", "get_deepscaler_rule_based_reward",
           "grade_answer_verl"]
