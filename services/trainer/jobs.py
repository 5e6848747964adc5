"""The job registry: accepts validated specs, runs them one at a time on a worker thread, records events.

It knows nothing of gRPC or HTTP; `server.py` and `rest.py` translate. The training itself is the `Runner` it is
given (the driver, `driver.loop.train`, through `worker.Dispatcher` on a multi-rank trainer).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import FailedPrecondition, NotFound
from services.trainer.driver.metrics import JOBS
from services.trainer.spec import JobSpec

log = logging.getLogger(__name__)


class JobState(enum.Enum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass
class JobEvent:
    job_id: str
    seq: int
    state: JobState
    rollout_id: int
    metrics: dict[str, float]
    message: str
    time: float


@dataclass
class Job:
    spec: JobSpec
    state: JobState = JobState.QUEUED
    rollout_id: int = -1
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""
    created_at: float = field(default_factory=time.time)
    finished_at: float = 0.0
    events: list[JobEvent] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def job_id(self) -> str:
        return self.spec.job_id


class JobCancelled(Exception):
    """Raised inside a running job when it is cancelled."""


class JobContext:
    """What a running job sees of the registry: progress reporting and cancellation."""

    def __init__(self, registry: JobRegistry, job: Job) -> None:
        self._registry = registry
        self.job = job

    def report(self, rollout_id: int, metrics: dict[str, float], message: str = "") -> None:
        self._registry.record(self.job, rollout_id=rollout_id, metrics=metrics, message=message)

    def check_cancelled(self) -> None:
        if self.job.cancel.is_set():
            raise JobCancelled(f"job {self.job.job_id} was cancelled")


Runner = Callable[[JobSpec, JobContext], None]

MAX_REASON_CHARS = 2000


def failure_reason(err: BaseException) -> str:
    """One line for a job's error: the exception's type and message; for torch's CheckpointException (its message
    is every rank's traceback), each failing rank's own exception instead."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = "; ".join(f"rank {rank}: {_one_line(_unwrap(cause))}" for rank, cause in sorted(failures.items()))
        text = f"{type(err).__name__}: {causes}"
    else:
        text = _one_line(err)
    return text[:MAX_REASON_CHARS]


def _unwrap(cause: object) -> BaseException | object:
    return cause[0] if isinstance(cause, tuple) else cause  # DCP keeps (exception, traceback) pairs


def _one_line(err: object) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


class JobRegistry:
    """Jobs in submission order; one worker thread runs them FIFO with `runner`."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="job-worker", daemon=True)
        self._worker.start()

    def submit(self, spec: JobSpec) -> Job:
        with self._lock:
            if spec.job_id in self._jobs:
                raise FailedPrecondition(f"job {spec.job_id!r} already exists")
            job = Job(spec=spec)
            self._jobs[spec.job_id] = job
        self.record(job, message="queued")
        self._queue.put(job)
        log.info("job %s queued", spec.job_id)
        return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} not found")
        return job

    def list(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state.terminal:
            return job
        job.cancel.set()
        if job.state == JobState.QUEUED:
            self._finish(job, JobState.CANCELLED, "cancelled before it started")
        return job

    def events_after(self, job_id: str, after_seq: int) -> list[JobEvent]:
        job = self.get(job_id)
        with self._lock:
            return [e for e in job.events if e.seq > after_seq]

    def record(self, job: Job, *, rollout_id: int | None = None, metrics: dict[str, float] | None = None,
               message: str = "", state: JobState | None = None) -> None:
        with self._lock:
            if state is not None:
                job.state = state
            if rollout_id is not None:
                job.rollout_id = rollout_id
            if metrics:
                job.metrics = dict(metrics)
            job.events.append(JobEvent(job_id=job.job_id, seq=len(job.events) + 1, state=job.state,
                                       rollout_id=job.rollout_id, metrics=dict(metrics or {}), message=message,
                                       time=time.time()))

    def _finish(self, job: Job, state: JobState, message: str) -> None:
        if job.state.terminal:
            return
        job.finished_at = time.time()
        if state == JobState.FAILED:
            job.error = message
        self.record(job, state=state, message=message)
        JOBS.labels(state=state.value).inc()
        log.info("job %s %s: %s", job.job_id, state.value.lower(), message)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._run(job)
            except BaseException:  # noqa: BLE001 - the worker outlives any job; health reports it otherwise
                log.exception("job worker: job %s left the worker in an unexpected state", job.job_id)

    def _run(self, job: Job) -> None:
        if job.state.terminal:
            return
        self.record(job, state=JobState.RUNNING, message="running")
        try:
            self._runner(job.spec, JobContext(self, job))
        except JobCancelled as err:
            self._finish(job, JobState.CANCELLED, str(err))
        # BaseException: torch's CheckpointException is one, and SystemExit in this thread would end only the
        # thread, leaving the job RUNNING and the queue wedged behind it.
        except BaseException as err:  # noqa: BLE001 - a failed job must not stop the queue
            log.error("job %s failed", job.job_id, exc_info=True)
            self._finish(job, JobState.FAILED, failure_reason(err))
        else:
            self._finish(job, JobState.SUCCEEDED, "finished")

    def health(self) -> str:
        """Why the queue cannot make progress ("" when it can): its worker thread is gone, or the runner is out of
        step (a multi-rank runner's `broken`)."""
        if not self._worker.is_alive() and not self._closed:
            return "job worker thread is not running: queued jobs will not start; restart the trainer"
        return getattr(self._runner, "broken", "")

    def close(self) -> None:
        self._closed = True
        for job in self.list():
            job.cancel.set()
        self._queue.put(None)

    @staticmethod
    def to_dict(job: Job) -> dict[str, Any]:
        return {"job_id": job.job_id, "state": job.state.value, "spec": job.spec.model_dump(),
                "rollout_id": job.rollout_id, "num_rollout": job.spec.num_rollout, "metrics": job.metrics,
                "error": job.error, "created_at": job.created_at, "finished_at": job.finished_at}
