"""Score a batch of samples: each under its own timeout, a bounded number at once, failures kept per sample.

A built-in verifier runs in a worker thread; a user function (slime's `async def f(args, sample)`) runs on the loop.
Knows nothing of gRPC or HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import numbers
import types
from collections.abc import Awaitable, Callable
from typing import Any

from services.common import plugins
from services.common.errors import InvalidArgument
from services.common.plugin_sample import PluginSample
from services.common.samples import Sample
from services.reward import verifiers
from services.reward.client import ScoreResult

log = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENCY = 64


@functools.cache
def load_reward_function(path: str) -> Callable[..., Awaitable[Any]]:
    """Import a custom_rm_path once per path; InvalidArgument if it is missing or has the wrong signature."""
    return plugins.load_function(path, flag="custom_rm_path", expected="async def f(args, sample) -> float | dict",
                                 is_async=True, num_params=2)


async def score_samples(samples: list[Sample], *, rm_type: str, custom_rm_path: str, reward_key: str,
                        timeout_s: float, args: dict[str, Any],
                        semaphore: asyncio.Semaphore | None = None) -> list[ScoreResult]:
    """One ScoreResult per sample, in order. A sample's custom_rm_path wins over the request's, which wins over
    rm_type; a user function gets slime's Sample (`slime.utils.types.Sample`).

    `semaphore` bounds the samples scored at once (the server shares one over all requests); by default a fresh
    one of DEFAULT_MAX_CONCURRENCY. Raises InvalidArgument for a bad request, never for a failing sample.
    """
    if not timeout_s > 0:
        raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
    if custom_rm_path:
        load_reward_function(custom_rm_path)
        name = f"custom_rm_path {custom_rm_path}"
    else:
        verifiers.check_job_rm_type(rm_type)
        name = f"rm_type {rm_type}"
    namespace = types.SimpleNamespace(**args)

    def call(sample: Sample) -> Awaitable[Any]:
        """slime's order: the sample's own custom_rm_path, the job's, then the rm_type."""
        path = sample.custom_rm_path or custom_rm_path
        if path:
            return load_reward_function(path)(namespace, PluginSample.from_record(sample))
        return verifiers.score_builtin(sample, rm_type, args)

    semaphore = semaphore or asyncio.Semaphore(DEFAULT_MAX_CONCURRENCY)

    async def score_one(sample: Sample) -> ScoreResult:
        async with semaphore:
            try:
                value = await asyncio.wait_for(call(sample), timeout_s)
            except TimeoutError:
                log.warning("%s: sample %d timed out after %g s", name, sample.index, timeout_s)
                return ScoreResult(reward=0.0, ok=False, error=f"timed out after {timeout_s:g} s")
            except Exception as err:  # noqa: BLE001 - a failing scorer fails its sample, never the service
                log.warning("%s: sample %d failed: %s: %s", name, sample.index, type(err).__name__, err)
                return ScoreResult(reward=0.0, ok=False, error=f"{name}: {type(err).__name__}: {err}")
        return to_result(value, reward_key, name)

    return list(await asyncio.gather(*(score_one(s) for s in samples)))


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)


def to_result(value: Any, reward_key: str, name: str) -> ScoreResult:
    """A scorer's return value as a ScoreResult: a finite number, or a dict whose reward_key picks one."""
    scores: dict[str, float] = {}
    if isinstance(value, dict):
        scores = {str(k): float(v) for k, v in value.items() if _is_number(v)}
        keys = ", ".join(sorted(map(str, value)))
        if not reward_key:
            return ScoreResult(0.0, False, f"{name} returned a dict (keys: {keys}); set reward_key to one", scores)
        if reward_key not in value:
            return ScoreResult(0.0, False, f"{name}: reward_key {reward_key!r} not in its result (keys: {keys})",
                               scores)
        value = value[reward_key]
        name = f"{name} [{reward_key!r}]"
    if not _is_number(value) or not math.isfinite(float(value)):
        return ScoreResult(0.0, False, f"{name} returned {value!r}; expected a finite float or a dict of them",
                           scores)
    return ScoreResult(float(value), True, "", scores)
