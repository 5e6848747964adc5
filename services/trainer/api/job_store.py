"""Job records in Redis: each job's spec, state, error, checkpoints, latest metrics and its events (every state change
with its time and reason, every rollout's metrics), so a restarted job API answers as the one before it did.

Writes go behind the registry (`JobRegistry` keeps the live copy): a flusher thread persists each changed job, and
keeps retrying while Redis is away, so a Redis restart never fails a running job; what it had not written when the
trainer dies as well is the only loss. Events are a hash keyed by sequence number, so a retried write is idempotent.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger(__name__)

PREFIX = "physarum:jobapi"
INDEX = f"{PREFIX}:jobs"          # zset: job id -> submission number (the queue's order)
SEQUENCE = f"{PREFIX}:seq"         # the last submission number
SOCKET_TIMEOUT_S = 10.0
RETRY_MAX_S = 5.0
LOAD_TIMEOUT_S = 120.0             # how long a starting job API waits for Redis


def _record_key(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


def _events_key(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:events"


class RedisJobStore:
    """Persists jobs (each change hands over a `snapshot` function the flusher calls) and loads them back."""

    def __init__(self, redis_url: str) -> None:
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5.0)
        self._dirty: dict[str, Callable[[], tuple[dict, list[Any]]]] = {}
        self._written: dict[str, int] = {}  # job id -> events persisted (by seq)
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False  # the flusher is writing a job it took off _dirty
        self._flusher = threading.Thread(target=self._flush_loop, name="job-store", daemon=True)
        self._flusher.start()

    def next_order(self) -> int:
        """A new submission number (the queue's order across restarts)."""
        return int(self._retry("allocate a submission number", lambda: self.redis.incr(SEQUENCE)))

    def changed(self, job_id: str, snapshot: Callable[[], tuple[dict, list[Any]]]) -> None:
        """Mark `job_id` for writing; `snapshot()` returns its record fields and all its events."""
        with self._cond:
            self._dirty[job_id] = snapshot
            self._cond.notify()

    def load(self) -> list[tuple[dict, list[dict]]]:
        """Every job's record fields and events (by seq), in submission order; waits for Redis up to
        LOAD_TIMEOUT_S."""
        def read() -> list[tuple[dict, list[dict]]]:
            jobs = []
            for raw_id in self.redis.zrange(INDEX, 0, -1):
                job_id = raw_id.decode()
                fields = {k.decode(): v.decode() for k, v in self.redis.hgetall(_record_key(job_id)).items()}
                if not fields:
                    continue
                events = sorted((json.loads(v) for v in self.redis.hvals(_events_key(job_id))), key=lambda e: e["seq"])
                self._written[job_id] = len(events)
                jobs.append((fields, events))
            return jobs
        return self._retry("load the job records", read, deadline_s=LOAD_TIMEOUT_S)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every change so far is written; False if Redis did not take them in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._dirty or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is pending, then stop the flusher; returns within `timeout_s` in all (a write stuck on a Redis
        that does not answer is left to the daemon flusher)."""
        deadline = time.monotonic() + timeout_s
        if not self.flush(timeout_s):
            log.error("job store: %d jobs' last changes not written to Redis", len(self._dirty))
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._flusher.join(max(0.0, deadline - time.monotonic()))
        self.redis.close()

    def _flush_loop(self) -> None:
        backoff = 0.2
        while True:
            with self._cond:
                while not self._dirty and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job_id, snapshot = next(iter(self._dirty.items()))
                del self._dirty[job_id]
                self._busy = True
            try:
                self._write(job_id, *snapshot())
                backoff = 0.2
            except redis.RedisError as err:
                log.warning("job store: writing job %s failed (%s); retrying in %.1f s", job_id, err, backoff)
                with self._cond:
                    self._dirty.setdefault(job_id, snapshot)
                time.sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, job_id: str, fields: dict, events: list[Any]) -> None:
        new = [e for e in events if e.seq > self._written.get(job_id, 0)]
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(_record_key(job_id), mapping=fields)
        pipe.zadd(INDEX, {job_id: int(fields["order"])}, nx=True)
        if new:
            pipe.hset(_events_key(job_id), mapping={str(e.seq): json.dumps(event_dict(e)) for e in new})
        pipe.execute()
        if new:
            self._written[job_id] = new[-1].seq

    def _retry(self, what: str, fn: Callable, deadline_s: float = SOCKET_TIMEOUT_S * 3):
        deadline, backoff = time.monotonic() + deadline_s, 0.2
        while True:
            try:
                return fn()
            except redis.RedisError as err:
                if time.monotonic() + backoff > deadline:
                    from services.common.errors import Unavailable

                    raise Unavailable(f"job store: cannot {what}: Redis does not answer ({err})") from None
                log.warning("job store: %s: %s; retrying in %.1f s", what, err, backoff)
                time.sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)


def event_dict(event: Any) -> dict:
    """A jobs.JobEvent as JSON (its state by name)."""
    return {**event.__dict__, "state": event.state.value}
