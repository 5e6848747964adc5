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


class JobRegistry:
    """Jobs in submission order; one worker thread runs them FIFO with `runner`."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[Job | None] = queue.Queue()
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
            if job.state.terminal:
                continue
            self.record(job, state=JobState.RUNNING, message="running")
            try:
                self._runner(job.spec, JobContext(self, job))
            except JobCancelled as err:
                self._finish(job, JobState.CANCELLED, str(err))
            except Exception as err:  # noqa: BLE001 - a failed job must not kill the service
                log.exception("job %s failed", job.job_id)
                self._finish(job, JobState.FAILED, f"{type(err).__name__}: {err}")
            else:
                self._finish(job, JobState.SUCCEEDED, "finished")

    def close(self) -> None:
        for job in self.list():
            job.cancel.set()
        self._queue.put(None)

    @staticmethod
    def to_dict(job: Job) -> dict[str, Any]:
        return {"job_id": job.job_id, "state": job.state.value, "spec": job.spec.model_dump(),
                "rollout_id": job.rollout_id, "num_rollout": job.spec.num_rollout, "metrics": job.metrics,
                "error": job.error, "created_at": job.created_at, "finished_at": job.finished_at}
