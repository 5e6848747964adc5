"""The job registry: accepts validated specs, runs them one at a time on a worker thread (LoRA jobs that share a
base model, lora_share_pool, side by side), records events; with a job store (`job_store.py`, Redis) the records
outlive the process and unfinished jobs resume at the next start.

It knows nothing of gRPC or HTTP; `server.py` and `rest.py` translate. The training itself is the `Runner` it is
given (the driver, `driver.loop.train`, through `worker.Dispatcher` on a multi-rank trainer). Nothing a job raises
stops the queue.
"""

from __future__ import annotations

import enum
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from services.common.errors import FailedPrecondition, NotFound
from services.trainer.api.auth import new_job_token
from services.trainer.api.spec import JobSpec
from services.trainer.driver.job import JobCancelled, JobPreempted, RanksLost, shared_base_key
from services.trainer.driver.metrics import PREFIX

if TYPE_CHECKING:
    from services.trainer.api.job_store import RedisJobStore

log = logging.getLogger(__name__)

JOBS = Counter(f"{PREFIX}jobs_finished", "jobs that ended, by final state", ["state"])


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
    order: int = 0                  # submission number: the queue's order, across restarts
    attempts: int = 0               # starts after the first: times the trainer stopped while the job ran
    checkpoints: list[int] = field(default_factory=list)  # rollouts a checkpoint was saved after
    stalls: int = 0                 # interruptions in a row, each without progress since the start before it
    started_at: tuple[int, int] = (-1, -1)  # (rollout_id, latest checkpoint) when the job last started running
    token_digest: str = ""  # SHA-256 of the job's own token (`auth.py`), kept with the record
    token: str = field(default="", repr=False)  # the token itself: in memory from its submit only, for the reply

    @property
    def latest_checkpoint(self) -> int:
        return self.checkpoints[-1] if self.checkpoints else -1

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def transitions(self) -> list[JobEvent]:
        """The events that changed the job's state (the first is its submission)."""
        changes, state = [], None
        for event in self.events:
            if event.state != state:
                changes.append(event)
                state = event.state
        return changes


class JobContext:
    """What a running job sees of the registry (the driver's JobControl): progress reporting and cancellation."""

    def __init__(self, registry: JobRegistry, job: Job) -> None:
        self._registry = registry
        self.job = job

    def report(self, rollout_id: int, metrics: dict[str, float], message: str = "") -> None:
        self._registry.record(self.job, rollout_id=rollout_id, metrics=metrics, message=message)

    def has_metrics(self, rollout_id: int) -> bool:
        return any(e.rollout_id == rollout_id and e.metrics for e in list(self.job.events))

    def check_cancelled(self) -> None:
        if self._registry.stopping.is_set():
            raise JobPreempted(f"job {self.job.job_id}: the trainer is stopping")
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
    """Jobs in submission order; one worker thread runs them FIFO with `runner`. Given a `store`, every change is
    persisted and the jobs of the job API before this one are loaded back: the unfinished ones queue again in their
    order, a job the trainer stopped in the middle of first (resuming from its latest checkpoint), unless it was
    interrupted (the trainer died or was evicted) more than `max_restarts` times in a row with no new checkpoint.

    While a lora_share_pool job runs, the queued lora_share_pool jobs of its base (`shared_base_key`) start beside
    it, each on a thread of its own; the next job in the queue starts once all of them have ended. With
    `share_pool` False (a trainer of several ranks, whose ranks run one job's collectives at a time) such jobs are
    refused at submit."""

    def __init__(self, runner: Runner, store: RedisJobStore | None = None, max_restarts: int = 3,
                 share_pool: bool = True) -> None:
        self._runner = runner
        self._store = store
        self._max_restarts = max_restarts
        self._share_pool = share_pool
        self._jobs: dict[str, Job] = {}
        self._lock = threading.RLock()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._group: tuple | None = None  # the shared base of the lora_share_pool jobs running now
        self._beside: list[threading.Thread] = []  # the threads of the jobs running beside the worker's
        self._taken: set[str] = set()  # queued jobs started beside: the worker passes them by
        self._orders = itertools.count(1)
        self._closed = False
        self.stopping = threading.Event()  # set by close(): the running job is preempted, not cancelled
        self.ranks_lost = threading.Event()  # a rank died mid-job: the process should exit for all ranks to restart
        if store is not None:
            self._load(store)
        self._worker = threading.Thread(target=self._work, name="job-worker", daemon=True)
        self._worker.start()

    def submit(self, spec: JobSpec) -> Job:
        if spec.lora_share_pool and not self._share_pool:
            raise FailedPrecondition("lora_share_pool: this trainer has several ranks, which run one job's "
                                     "collectives at a time; LoRA jobs share a trainer of one rank (world_size 1)")
        with self._lock:
            if spec.job_id in self._jobs:
                raise FailedPrecondition(f"job {spec.job_id!r} already exists")
            token, digest = new_job_token()
            job = Job(spec=spec, order=self._store.next_order() if self._store else next(self._orders),
                      token=token, token_digest=digest)
            self._jobs[spec.job_id] = job
        self.record(job, message="queued")
        with self._lock:  # the worker opens a group under it: a job joins it, or waits in the queue it scans
            if self._joins_group(job):
                self._start_beside(job)
            else:
                self._queue.put(job)
        log.info("job %s queued", spec.job_id)
        return job

    def _joins_group(self, job: Job) -> bool:
        """(The lock held.) Whether `job` starts now beside the running lora_share_pool jobs: it is one of their
        base's."""
        return self._group is not None and not self.stopping.is_set() and job.state == JobState.QUEUED and \
            job.spec.lora_share_pool and shared_base_key(job.spec) == self._group

    def _open_group(self, job: Job) -> None:
        """(The lock held.) The worker starts lora_share_pool `job`: the queued jobs of its base start beside it."""
        self._group = shared_base_key(job.spec)
        for queued in list(self._queue.queue):
            if queued is not None and queued is not job and self._joins_group(queued):
                self._taken.add(queued.job_id)
                self._start_beside(queued)

    def _start_beside(self, job: Job) -> None:
        thread = threading.Thread(target=self._run_beside, args=(job,), name=f"job-{job.job_id}", daemon=True)
        self._beside.append(thread)
        thread.start()
        log.info("job %s starts beside the running jobs of its base model", job.job_id)

    def _run_beside(self, job: Job) -> None:
        try:
            self._run(job)
        except BaseException:  # noqa: BLE001 - as the worker: logged, the other jobs run on
            log.exception("job %s left its thread in an unexpected state", job.job_id)

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} not found")
        return job

    def token_digest(self, job_id: str) -> str:
        """The digest of job `job_id`'s own token ("" for no such job)."""
        with self._lock:
            job = self._jobs.get(job_id)
        return job.token_digest if job is not None else ""

    def list(self, state: JobState | None = None) -> list[Job]:
        """Jobs in submission order, only those in `state` when given."""
        with self._lock:
            return sorted((j for j in self._jobs.values() if state is None or j.state == state),
                          key=lambda j: j.order)

    def queue(self) -> list[Job]:
        """The running jobs, then the queued ones in the order they will run."""
        return self.list(JobState.RUNNING) + self.list(JobState.QUEUED)

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
            if rollout_id is not None and rollout_id >= 0:  # -1: a note before the first rollout (the dataset)
                job.rollout_id = rollout_id
            if metrics:
                job.metrics = dict(metrics)
                if CHECKPOINT_METRIC in metrics and rollout_id is not None:
                    job.checkpoints.append(rollout_id)
            job.events.append(JobEvent(job_id=job.job_id, seq=len(job.events) + 1, state=job.state,
                                       rollout_id=job.rollout_id, metrics=dict(metrics or {}), message=message,
                                       time=time.time()))
        if self._store is not None:
            self._store.changed(job.job_id, lambda: self._snapshot(job))

    def _snapshot(self, job: Job) -> tuple[dict[str, str], list[JobEvent]]:
        with self._lock:
            return record_fields(job), list(job.events)

    def _load(self, store: RedisJobStore) -> None:
        for fields, events in store.load():
            job = job_from_record(fields, events)
            self._jobs[job.job_id] = job
        for job in self.list():
            if job.state == JobState.RUNNING:
                self._interrupted(job)
            if job.state == JobState.QUEUED:
                self._queue.put(job)
        log.info("job store: %d jobs loaded, %d queued", len(self._jobs), self._queue.qsize())

    def _interrupted(self, job: Job) -> None:
        """A job RUNNING in the records of a job API that is gone: the trainer died in the middle of it."""
        job.attempts += 1  # what it trained since its start is kept only up to its latest checkpoint
        if self._stalled(job, "the trainer stopped while the job ran",
                         progressed=job.latest_checkpoint > job.started_at[1]):
            return
        self.record(job, state=JobState.QUEUED, message=f"the trainer stopped while the job ran: it resumes from its "
                                                        f"latest checkpoint (restart {job.attempts}; {job.stalls} "
                                                        f"in a row without progress, at most "
                                                        f"{self._max_restarts})")

    def _ranks_lost(self, job: Job, err: RanksLost) -> None:
        """A collective between the trainer's ranks broke (a rank died): counted as the trainer dying in the middle
        of the job, which resumes from its latest checkpoint once all the ranks start again. No job starts before
        that: `ranks_lost` tells the process to exit (non-zero), for its supervisor to restart the ranks."""
        self.stopping.set()  # the next job waits for the restart too
        job.attempts += 1
        try:
            if not self._stalled(job, "a trainer rank was lost while the job ran",
                                 progressed=job.latest_checkpoint > job.started_at[1]):
                self.record(job, state=JobState.QUEUED, message=f"{RANK_LOST}: {err}; the job resumes from its latest "
                                                                f"checkpoint when all the ranks are back (restart "
                                                                f"{job.attempts}; {job.stalls} in a row without "
                                                                f"progress, at most {self._max_restarts})")
        finally:
            self.ranks_lost.set()

    def _stalled(self, job: Job, cause: str, *, progressed: bool) -> bool:
        """Count an interruption of `job` (the trainer died, or was stopped, while it ran): in a row with the one
        before unless the job `progressed` since it last started. More than max_restarts in a row: the job fails the
        same way each time (it stops before it gets further), so it is FAILED, not resumed again."""
        job.stalls = 0 if progressed else job.stalls + 1
        if job.stalls <= self._max_restarts:
            return False
        self._finish(job, JobState.FAILED, f"{cause} (at rollout {job.rollout_id}), {job.stalls} times in a row "
                                           f"without progress (at most {self._max_restarts} restarts): not resumed "
                                           f"again")
        return True

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
            with self._lock:
                if job.job_id in self._taken:  # it started beside an earlier job
                    self._taken.discard(job.job_id)
                    continue
                if job.spec.lora_share_pool and job.state == JobState.QUEUED and not self.stopping.is_set():
                    self._open_group(job)
            try:
                self._run(job)
            except BaseException:  # noqa: BLE001 - the worker outlives any job; health reports it otherwise
                log.exception("job worker: job %s left the worker in an unexpected state", job.job_id)
            self._end_group()

    def _end_group(self) -> None:
        """Wait for the jobs running beside the worker's (more may join meanwhile), then close the group."""
        while True:
            with self._lock:
                running = [thread for thread in self._beside if thread.is_alive()]
                if not running:
                    self._group, self._beside = None, []
                    return
            for thread in running:
                thread.join()

    def _run(self, job: Job) -> None:
        if job.state.terminal or self.stopping.is_set():
            return
        resumed = job.attempts > 0 or any(e.message.startswith(PREEMPTED) for e in job.events)
        job.started_at = (job.rollout_id, job.latest_checkpoint)
        self.record(job, state=JobState.RUNNING, message="running" + (" (resumed)" if resumed else ""))
        try:
            self._runner(resume_spec(job.spec) if resumed else job.spec, JobContext(self, job))
        except JobPreempted:
            # the rollouts trained since the start are checkpointed at the safe point the job stopped at
            if not self._stalled(job, "the trainer was stopped (SIGTERM) while the job ran",
                                 progressed=job.rollout_id > job.started_at[0]):
                self.record(job, state=JobState.QUEUED, message=f"{PREEMPTED}: the trainer stopped; the job "
                                                                "resumes from its latest checkpoint at the next start")
        except RanksLost as err:
            self._ranks_lost(job, err)
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

    def close(self, timeout_s: float = 30.0, records_timeout_s: float = 10.0) -> None:
        """Stop: the running job is preempted at its next check (it stays unfinished, to resume at the next start;
        it gets `timeout_s`), queued jobs stay queued; then the records are written (up to `records_timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        self._closed = True
        self.stopping.set()
        self._queue.put(None)
        self._worker.join(timeout_s)
        for thread in list(self._beside):
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._store is not None:
            self._store.close(records_timeout_s)

    @staticmethod
    def to_dict(job: Job) -> dict[str, Any]:
        return {"job_id": job.job_id, "state": job.state.value, "spec": job.spec.model_dump(),
                "rollout_id": job.rollout_id, "num_rollout": job.spec.num_rollout, "metrics": job.metrics,
                "error": job.error, "created_at": job.created_at, "finished_at": job.finished_at,
                "attempts": job.attempts, "checkpoints": job.checkpoints,
                "transitions": [{"state": e.state.value, "time": e.time, "reason": e.message}
                                for e in job.transitions]}


PREEMPTED = "preempted"
RANK_LOST = "a trainer rank was lost"
CHECKPOINT_METRIC = "perf/save_seconds"  # in a rollout's metrics when the loop saved a checkpoint after it


def resume_spec(spec: JobSpec) -> JobSpec:
    """The spec a resumed job runs with: `load` from its own `save` once that holds a checkpoint (the latest one)."""
    from services.trainer.checkpoint.iterations import latest_iteration

    if spec.save and latest_iteration(spec.save) is not None:
        return spec.model_copy(update={"load": spec.save, "ckpt_step": None})
    return spec


def record_fields(job: Job) -> dict[str, str]:
    """A job's Redis hash (its events are stored apart)."""
    return {"order": str(job.order), "spec": job.spec.model_dump_json(), "state": job.state.value,
            "rollout_id": str(job.rollout_id), "metrics": json.dumps(job.metrics), "error": job.error,
            "created_at": repr(job.created_at), "finished_at": repr(job.finished_at), "attempts": str(job.attempts),
            "checkpoints": json.dumps(job.checkpoints), "stalls": str(job.stalls),
            "started_at": json.dumps(job.started_at), "token_digest": job.token_digest}


def job_from_record(fields: dict[str, str], events: list[dict]) -> Job:
    return Job(spec=JobSpec.model_validate_json(fields["spec"]), state=JobState(fields["state"]),
               rollout_id=int(fields["rollout_id"]), metrics=json.loads(fields["metrics"]), error=fields["error"],
               created_at=float(fields["created_at"]), finished_at=float(fields["finished_at"]),
               order=int(fields["order"]), attempts=int(fields["attempts"]),
               checkpoints=json.loads(fields["checkpoints"]), stalls=int(fields.get("stalls", "0")),
               started_at=tuple(json.loads(fields.get("started_at", "[-1, -1]"))),
               token_digest=fields.get("token_digest", ""),
               events=[JobEvent(**{**e, "state": JobState(e["state"])}) for e in events])
