"""slime.rollout.rm_hub: async_rm and batched_async_rm, slime's reward entry points. In the rollout manager (inside a
rollout or eval) they score through the reward service, with the job's rm_type and the sample's or job's
custom_rm_path, as the service scores its own groups; elsewhere (in the reward service, which runs a custom reward
function that calls them) they run slime's rule-based reward models here."""

from __future__ import annotations

import asyncio
from typing import Any

from services.reward import verifiers
from services.reward.rm.math import deepscaler_reward as get_deepscaler_rule_based_reward
from services.rollout.engine_calls.generate import GenerateContext, bound_context
from slime.rollout.rm_hub.math_utils import extract_answer as extract_boxed_answer
from slime.rollout.rm_hub.math_utils import grade_answer_verl
from slime.utils.misc import load_function


def _rollout_context() -> GenerateContext | None:
    """The rollout (or eval) the calling task belongs to, when it has a reward-service scorer."""
    ctx = bound_context()
    return ctx if ctx is not None and ctx.scorer is not None else None


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """The sample's reward. slime's order: the sample's custom_rm_path, the job's, then the job's rm_type (or the
    sample's metadata rm_type)."""
    ctx = _rollout_context()
    if ctx is not None:
        return (await _service_rewards(ctx, [sample]))[0]
    path = getattr(sample, "custom_rm_path", None) or getattr(args, "custom_rm_path", None)
    if path:
        return await load_function(path)(args, sample, **kwargs)
    return await verifiers.score_builtin(sample, getattr(args, "rm_type", None) or "", vars(args))


async def batched_async_rm(args: Any, samples: list[Any], **kwargs: Any) -> list[Any]:
    """The samples' rewards, in order. With group_rm, the job's custom_rm_path scores them together (in this
    process, as slime calls it)."""
    if getattr(args, "group_rm", False) and getattr(args, "custom_rm_path", None):
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    ctx = _rollout_context()
    if ctx is not None:
        return await _service_rewards(ctx, samples)
    if getattr(args, "custom_rm_path", None):
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))


async def _service_rewards(ctx: GenerateContext, samples: list[Any]) -> list[float]:
    """Rewards from the reward service: samples naming the job's custom_rm_path (or none) in the rollout's batched
    call, the others one call per path. A sample the service fails to score gets 0 and its reward_error, as the
    service's own groups do."""
    scorer, config = ctx.scorer, ctx.scorer.config
    by_path: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        by_path.setdefault(getattr(sample, "custom_rm_path", None) or config.custom_rm_path, []).append(i)
    results: list[Any] = [None] * len(samples)
    for path, positions in by_path.items():
        batch = [samples[i] for i in positions]
        if path == config.custom_rm_path:
            scored = await scorer.score(batch)
        else:
            scored = await asyncio.to_thread(
                scorer.reward.score, batch, rm_type=config.rm_type, custom_rm_path=path,
                reward_key=config.reward_key, timeout_s=config.reward_timeout_s, args=config.args)
        for i, result in zip(positions, scored, strict=True):
            results[i] = result
    rewards = []
    for sample, result in zip(samples, results, strict=True):
        if not result.ok:
            sample.reward_error = result.error or "scoring failed"
        rewards.append(result.reward if result.ok else 0.0)
    return rewards


__all__ = ["async_rm", "batched_async_rm", "extract_boxed_answer", "get_deepscaler_rule_based_reward",
           "grade_answer_verl"]
