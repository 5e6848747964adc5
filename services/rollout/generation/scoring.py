"""Rewards for a finished group: the reward service, per sample (rm_type or custom_rm_path), or, with slime's
--group-rm, the user's `async def f(args, samples) -> list[float]`, called once per group in this process.

A failing scorer gives its samples reward 0 and a reward_error; it never fails the rollout. The groups of one rollout
that finish together are scored in one reward-service call (ServiceScorer). A sample sent to the reward service is
converted to its proto once: that proto, its reward set, is what the buffer write stores (encode_group).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.common import plugins
from services.common.errors import InvalidArgument, PhysarumError
from services.common.gen.physarum.v1 import sample_pb2
from services.common.plugin_sample import PluginSample
from services.common.samples import Sample, sample_to_proto, set_reward_fields
from services.common.settings.rollout import RolloutConfig
from services.rollout.generation.batcher import Batcher

if TYPE_CHECKING:
    from services.reward.client import RewardClient

log = logging.getLogger(__name__)

GROUP_EXPECTED = "async def f(args, samples) -> list[float]"
MAX_SAMPLES_PER_CALL = 1024  # one reward-service call scores at most this many samples (whole groups)


class ServiceScorer:
    """The reward service for one rollout (or eval): the groups waiting to be scored go out in one call."""

    def __init__(self, reward: RewardClient, config: RolloutConfig) -> None:
        self.reward, self.config = reward, config
        self.batcher: Batcher[list[sample_pb2.Sample], list[Any]] = Batcher(self._score_groups, MAX_SAMPLES_PER_CALL,
                                                                            size=len)

    async def score(self, samples: list[sample_pb2.Sample]) -> list[Any]:
        """The reward service's ScoreResult for each sample (raises what RewardClient.score raises)."""
        return await self.batcher.submit(samples)

    async def _score_groups(self, groups: list[list[sample_pb2.Sample]]) -> list[list[Any]]:
        config = self.config
        results = await asyncio.to_thread(
            self.reward.score, [s for group in groups for s in group], rm_type=config.rm_type,
            custom_rm_path=config.custom_rm_path, reward_key=config.reward_key, timeout_s=config.reward_timeout_s,
            args=config.args)
        out, start = [], 0
        for group in groups:
            out.append(results[start:start + len(group)])
            start += len(group)
        return out


@functools.cache
def load_group_reward(path: str) -> Callable[..., Any]:
    if not path:
        raise InvalidArgument(f"group_rm needs custom_rm_path: {GROUP_EXPECTED}")
    return plugins.load_function(path, flag="custom_rm_path (group_rm)", expected=GROUP_EXPECTED, is_async=True,
                                 num_params=2)


async def score_group(scorer: ServiceScorer, args: Any, samples: list[Sample],
                      what: str) -> list[sample_pb2.Sample | None]:
    """Set reward, reward_scores and reward_error on every sample of the group. As in slime, a reward the generate
    function already set is kept (only group_rm rescores the whole group). Returns, beside each sample, the proto
    it was sent to the reward service as, with its reward set (None where it was not sent)."""
    config = scorer.config
    if config.group_rm:
        await _score_with_group_function(config, args, samples, what)
        return [None] * len(samples)
    preset = [s for s in samples if isinstance(s, PluginSample) and s.reward is not None]
    for sample in preset:
        sample.reward, sample.reward_scores, sample.reward_error = _reward_value(
            sample.reward, config.reward_key, "the reward the generate function set")
    todo = [s for s in samples if not any(s is p for p in preset)]
    encoded = await _score_with_service(scorer, todo, what) if todo else []
    by_sample = {id(sample): msg for sample, msg in zip(todo, encoded, strict=True)}
    return [by_sample.get(id(sample)) for sample in samples]


async def _score_with_service(scorer: ServiceScorer, samples: list[Sample], what: str) -> list[sample_pb2.Sample]:
    encoded = [sample_to_proto(s) for s in samples]
    try:
        results = await scorer.score(encoded)
    except InvalidArgument:
        raise
    except PhysarumError as err:
        log.warning("%s: scoring %d samples failed, reward 0: %s", what, len(samples), err)
        for sample in samples:
            sample.reward, sample.reward_error = 0.0, f"reward service: {err}"
    else:
        for sample, result in zip(samples, results, strict=True):
            sample.reward = result.reward if result.ok else 0.0
            sample.reward_scores = dict(result.scores or {})
            sample.reward_error = "" if result.ok else (result.error or "scoring failed")
    for sample, msg in zip(samples, encoded, strict=True):
        set_reward_fields(msg, sample)
    return encoded


async def _score_with_group_function(config: RolloutConfig, args: Any, samples: list[Sample], what: str) -> None:
    fn = load_group_reward(config.custom_rm_path)
    name = f"group_rm {config.custom_rm_path}"
    try:
        values = await asyncio.wait_for(fn(args, samples), config.reward_timeout_s)
        if not isinstance(values, (list, tuple)) or len(values) != len(samples):
            raise ValueError(f"returned {values!r}; expected a list of {len(samples)} rewards")
    except Exception as err:  # noqa: BLE001 - a failing reward function fails its samples, never the rollout
        error = f"timed out after {config.reward_timeout_s:g} s" if isinstance(err, TimeoutError) else \
            f"{type(err).__name__}: {err}"
        log.warning("%s: %s failed: %s", what, name, error)
        for sample in samples:
            sample.reward, sample.reward_error = 0.0, f"{name}: {error}"
        return
    for sample, value in zip(samples, values, strict=True):
        sample.reward, sample.reward_scores, sample.reward_error = _reward_value(value, config.reward_key, name)


def _reward_value(value: Any, reward_key: str, name: str) -> tuple[float, dict[str, float], str]:
    """(reward, reward_scores, reward_error) from a number, or from a dict whose reward_key picks the number."""
    scores: dict[str, float] = {}
    if isinstance(value, dict):
        scores = {str(k): float(v) for k, v in value.items() if isinstance(v, numbers.Real)}
        if reward_key not in value:
            return 0.0, scores, f"{name}: a dict reward (keys {', '.join(map(str, value))}) needs reward_key"
        value = value[reward_key]
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return 0.0, scores, f"{name}: reward {value!r} is not a finite number"
    return float(value), scores, ""
