"""Score a batch of samples: each under its own timeout, a bounded number at once, failures kept per sample.

Built-in verifiers and user functions (slime's `async def f(args, sample)`) run in `workers`' processes, which
call `call_scorer` there. Knows nothing of gRPC or HTTP.
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
from services.common.samples import Sample
from services.reward.client import ScoreResult
from services.reward.verifiers import builtin_scorer
from services.reward.workers import Task, WorkerPool

log = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENCY = 64
MAX_TIMEOUT_S = 3600.0
_shared_pool: WorkerPool | None = None


@functools.cache
def load_reward_function(path: str) -> Callable[..., Awaitable[Any]]:
    """Import a custom_rm_path once per path; InvalidArgument if it is missing or has the wrong signature."""
    return plugins.load_function(path, flag="custom_rm_path", expected="async def f(args, sample) -> float | dict",
                                 is_async=True, num_params=2)


async def call_scorer(kind: str, target: str, sample: Sample, args: dict[str, Any]) -> Any:
    """What the scorer returns for one sample; runs inside a worker process, never in the service."""
    if kind == "custom":
        return await load_reward_function(target)(types.SimpleNamespace(**args), sample)
    return builtin_scorer(target)(sample.response, sample.label)


def shared_pool() -> WorkerPool:
    """The process's default pool, for callers that bring none (a server brings its own, sized by its config)."""
    global _shared_pool
    if _shared_pool is None:
        _shared_pool = WorkerPool()
    return _shared_pool


async def score_samples(samples: list[Sample], *, rm_type: str, custom_rm_path: str, reward_key: str,
                        timeout_s: float, args: dict[str, Any], semaphore: asyncio.Semaphore | None = None,
                        pool: WorkerPool | None = None) -> list[ScoreResult]:
    """One ScoreResult per sample, in order. custom_rm_path wins over rm_type.

    `semaphore` bounds the samples scored at once (the server shares one over all requests); by default a fresh
    one of DEFAULT_MAX_CONCURRENCY. Each sample runs in one of `pool`'s workers (default: `shared_pool()`), killed
    past timeout_s. Raises InvalidArgument for a bad request, never for a failing sample.
    """
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise InvalidArgument(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s}")
    if not custom_rm_path:
        builtin_scorer(rm_type)  # an unknown rm_type fails the request here, listing the valid ones
    kind, target = ("custom", custom_rm_path) if custom_rm_path else ("builtin", rm_type)
    semaphore = semaphore or asyncio.Semaphore(DEFAULT_MAX_CONCURRENCY)
    pool = pool or shared_pool()

    async def score_one(sample: Sample) -> ScoreResult:
        async with semaphore:
            outcome = await pool.run(Task(kind, target, reward_key, sample, args), timeout_s)
        return ScoreResult(outcome.reward, outcome.ok, outcome.error, outcome.scores)

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
