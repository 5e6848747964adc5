"""Score a batch of samples: each under its own timeout, a bounded number at once, failures kept per sample.

Built-in verifiers and user functions (slime's `async def f(args, sample)`) run in `workers`' processes (see
`one_sample` for what runs there). Knows nothing of gRPC or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from services.common.errors import InvalidArgument
from services.common.gen.physarum.v1 import sample_pb2
from services.common.samples import Sample
from services.reward import verifiers
from services.reward.client import ScoreResult
from services.reward.workers import Run, WorkerPool

log = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENCY = 64
RUNS_PER_WORKER = 4  # a request's samples go to the workers in about this many runs per worker
MAX_RUN_LENGTH = 32  # samples per run at most (a run costs one message to a worker and its reply)
MAX_TIMEOUT_S = 3600.0
_shared_pool: WorkerPool | None = None


def shared_pool() -> WorkerPool:
    """The process's default pool, for callers that bring none (a server brings its own, sized by its config)."""
    global _shared_pool
    if _shared_pool is None:
        _shared_pool = WorkerPool()
    return _shared_pool


async def score_samples(samples: Sequence[Sample | sample_pb2.Sample], *, rm_type: str, custom_rm_path: str,
                        reward_key: str, timeout_s: float, args: dict[str, Any],
                        semaphore: asyncio.Semaphore | None = None,
                        pool: WorkerPool | None = None) -> list[ScoreResult]:
    """One ScoreResult per sample (a Sample, or a proto Sample that its worker decodes), in order. A sample's
    custom_rm_path wins over the request's, which wins over rm_type; a user function gets slime's Sample
    (`slime.utils.types.Sample`).

    `semaphore` bounds the samples scored at once (the server shares one over all requests); by default a fresh
    one of DEFAULT_MAX_CONCURRENCY. Each sample runs in one of `pool`'s workers (default: `shared_pool()`), killed
    past timeout_s; a large request goes to the workers in runs of samples (run_length), each run scored one sample
    after another (`WorkerPool.run_all`). Raises InvalidArgument for a bad request, never for a failing sample.
    """
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise InvalidArgument(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s}")
    if not custom_rm_path:
        verifiers.check_job_rm_type(rm_type)  # an unknown rm_type fails the request here, listing the valid ones
    semaphore = semaphore or asyncio.Semaphore(DEFAULT_MAX_CONCURRENCY)
    pool = pool or shared_pool()
    # a proto goes to its worker as the bytes it came in (decoded there), a run of them in one message
    sent = [s if isinstance(s, Sample) else s.SerializeToString() for s in samples]
    size = run_length(len(sent), pool.num_workers)
    runs = [Run(rm_type, custom_rm_path, reward_key, args, sent[i:i + size]) for i in range(0, len(sent), size)]
    return [result for run in await pool.run_all(runs, timeout_s, semaphore) for result in run]


def run_length(num_samples: int, num_workers: int) -> int:
    """Samples a worker takes in one message: about RUNS_PER_WORKER runs per worker, so a slow run cannot leave the
    others idle for long, and at most MAX_RUN_LENGTH; a small request goes out a sample at a time."""
    return max(1, min(MAX_RUN_LENGTH, num_samples // (RUNS_PER_WORKER * num_workers)))
