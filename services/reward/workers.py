"""Score samples in worker processes, so user code cannot take the Reward service down.

A worker runs one sample at a time under an address-space limit; past its timeout it is killed (SIGKILL) and
replaced; whatever it raises, SystemExit and KeyboardInterrupt included, fails only its sample. A worker takes a run of
samples in one message (a `Run`: the request's settings and the samples, each sample's Task built in the worker) and
answers each as it ends, so each sample keeps its own timeout; a request's runs go to the workers through one queue,
a pool thread per worker taking the next run as it ends one. The worker sends back JSON (a plain reward: its 8
bytes), never a pickle, so nothing it returns can run code here. The service's event loop only waits, so health
checks answer while workers run. Scoring itself (what a verifier or function returns) is left to `one_sample`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import multiprocessing
import os
import resource
import select
import signal
import struct
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, overload

from services.common.errors import InvalidArgument
from services.common.gen.physarum.v1 import sample_pb2
from services.common.samples import Sample
from services.reward.client import ScoreResult

log = logging.getLogger(__name__)

MAX_REPLY_BYTES = 1 << 20   # a worker's JSON reply; a longer one fails its sample and the worker is replaced
# the reply for an ok score with no dict of scores (most of them): the reward alone, 8 bytes, no JSON to write or
# parse; any JSON reply is longer
PLAIN_REPLY = struct.Struct("<d")
MAX_ERROR_CHARS = 2000      # an error message is cut to this many characters
START_TIMEOUT_S = 120.0     # a worker imports the scorers before its first task: not counted in any sample's timeout
KINDS = ("custom", "builtin")


@dataclass(frozen=True)
class Task:
    """One sample to score: `target` is an import path (kind "custom") or an rm_type (kind "builtin")."""

    kind: str
    target: str
    reward_key: str
    # the sample, or its proto as the gRPC server received it (serialized, or parsed in the worker): the worker
    # decodes that one, so the service's loop neither builds the dataclass nor pickles it (one_sample.as_sample)
    sample: Sample | bytes | sample_pb2.Sample
    args: dict[str, Any] = field(default_factory=dict)
    request_path: bool = False  # the request's own custom_rm_path: code it cannot load fails the request
    index: int = 0  # the sample's index, for messages

    @property
    def name(self) -> str:
        return f"custom_rm_path {self.target}" if self.kind == "custom" else f"rm_type {self.target}"


@dataclass(frozen=True)
class Run:
    """A request's run of samples for one worker, sent as one message; reads as the list of their Tasks, each built
    when read (in the worker: the service builds and pickles no Task per sample). A sample's own custom_rm_path wins
    over the request's, which wins over rm_type (slime's order). `samples` holds records, or the serialized protos
    the gRPC server received."""

    rm_type: str
    custom_rm_path: str
    reward_key: str
    args: dict[str, Any]
    samples: Sequence[Sample] | Sequence[bytes]

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Task]:
        return (self._task(sample) for sample in self.samples)

    @overload
    def __getitem__(self, position: int) -> Task: ...
    @overload
    def __getitem__(self, position: slice) -> Run: ...

    def __getitem__(self, position: int | slice) -> Task | Run:
        if isinstance(position, slice):
            return Run(self.rm_type, self.custom_rm_path, self.reward_key, self.args, self.samples[position])
        return self._task(self.samples[position])

    def _task(self, sample: Sample | bytes) -> Task:
        if isinstance(sample, bytes):
            sample = sample_pb2.Sample.FromString(sample)
        path = sample.custom_rm_path or self.custom_rm_path
        if path:
            return Task("custom", path, self.reward_key, sample, self.args, request_path=not sample.custom_rm_path,
                        index=sample.index)
        return Task("builtin", self.rm_type, self.reward_key, sample, self.args, index=sample.index)


class _Worker:
    """One process and the pipe to it; used by one pool thread at a time."""

    def __init__(self, memory_limit_bytes: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # no copy of the service's threads, loop or sockets
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, memory_limit_bytes), daemon=True,
                                   name="reward-worker")
        self.process.start()
        child.close()
        # one poll object for the pipe's life: Connection.poll builds and tears down a selector per call
        self._poller = select.poll()
        self._poller.register(self.conn.fileno(), select.POLLIN)
        if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv_bytes() != b"ready":
            self.kill()
            raise RuntimeError(f"reward worker did not start within {START_TIMEOUT_S:g} s")

    def send(self, tasks: Run | list[Task]) -> None:
        """Hand the worker a run of tasks; it answers each in order (read them with `outcome`)."""
        try:
            self.conn.send(tasks)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self.kill()
            raise _Lost(f"worker exited (code {self.process.exitcode}) while scoring") from None

    def outcome(self, timeout_s: float) -> ScoreResult:
        """The outcome of the next task of the run sent; raises _Lost (after killing the worker) if it overran,
        died or answered nonsense. An `invalid` answer (the request names unusable code) ends the run in the
        worker too, so the worker stays usable."""
        try:
            if not self._poller.poll(timeout_s * 1000):  # a worker that exited reads as ready: EOF below
                raise _Lost(f"timed out after {timeout_s:g} s (worker killed)", named=False)
            data = self.conn.recv_bytes(MAX_REPLY_BYTES)
            if len(data) == PLAIN_REPLY.size:
                return ScoreResult(PLAIN_REPLY.unpack(data)[0], True)
            reply = json.loads(data)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.kill()
            raise _Lost(f"worker exited (code {self.process.exitcode}) while scoring") from None
        except (OSError, ValueError) as err:  # a reply over MAX_REPLY_BYTES, or not JSON
            raise _Lost(f"unusable worker reply ({type(err).__name__})") from None
        if reply["kind"] == "invalid":
            raise InvalidArgument(reply["error"])
        return ScoreResult(reply["reward"], reply["ok"], reply["error"], reply["scores"])

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class _Lost(Exception):
    """A worker that had to be given up; its sample fails with this message (after the task's name if `named`)."""

    def __init__(self, reason: str, named: bool = True) -> None:
        super().__init__(reason)
        self.named = named


class WorkerPool:
    """Up to num_workers processes, started on first use (or by `start`) and replaced when one is killed."""

    def __init__(self, num_workers: int = 4, memory_limit_bytes: int = 2 << 30) -> None:
        if num_workers <= 0:
            raise ValueError(f"num_workers must be > 0, got {num_workers}")
        self.num_workers = num_workers
        self.memory_limit_bytes = memory_limit_bytes
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="reward-worker")  # one per busy worker
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    async def start(self) -> None:
        """Start every worker now (in threads), so the first requests do not wait for interpreters to start."""
        loop = asyncio.get_running_loop()
        started = await asyncio.gather(*(loop.run_in_executor(self._threads, _Worker, self.memory_limit_bytes)
                                         for _ in range(self.num_workers)))
        with self._lock:
            self._idle.extend(started)

    async def run(self, task: Task, timeout_s: float) -> ScoreResult:
        """Score one sample; InvalidArgument if the task names code that cannot be loaded."""
        return (await self.run_many([task], timeout_s))[0]

    async def run_many(self, tasks: Run | list[Task], timeout_s: float) -> list[ScoreResult]:
        """Score samples one after another in one worker, each under its own timeout (a sample that overruns or
        kills its worker fails alone; the rest go on in a fresh one); InvalidArgument if a task names code that
        cannot be loaded."""
        _check_kinds(tasks)
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._run, tasks, timeout_s)

    async def run_all(self, runs: list[Run], timeout_s: float, semaphore: asyncio.Semaphore) -> list[list[ScoreResult]]:
        """Score runs as `run_many` does each, on up to num_workers workers at once: a pool thread takes the next run
        of the queue as it ends one, so a slow run holds up only its own worker, and the event loop hands over a
        request once per worker, not once per run. Each busy worker holds one of `semaphore`'s slots (it scores
        one sample at a time). InvalidArgument, or the request's cancelling, drops the runs not yet started."""
        for run in runs:
            _check_kinds(run)
        queue = collections.deque(enumerate(runs))
        outcomes: list[list[ScoreResult]] = [[] for _ in runs]
        loop = asyncio.get_running_loop()

        async def one_worker() -> None:
            async with semaphore:
                try:
                    await loop.run_in_executor(self._threads, self._drain, queue, outcomes, timeout_s)
                except BaseException:
                    queue.clear()
                    raise
        await asyncio.gather(*(one_worker() for _ in range(min(self.num_workers, len(runs)))))
        return outcomes

    def _drain(self, queue: collections.deque[tuple[int, Run]], outcomes: list[list[ScoreResult]],
               timeout_s: float) -> None:
        while True:
            try:
                position, run = queue.popleft()
            except IndexError:
                return
            try:
                outcomes[position] = self._run(run, timeout_s)
            except BaseException:
                queue.clear()  # the request fails: its other runs are not scored
                raise

    def _run(self, tasks: Run | list[Task], timeout_s: float) -> list[ScoreResult]:
        outcomes: list[ScoreResult] = []
        while len(outcomes) < len(tasks):
            with self._lock:
                if self._closed:
                    raise InvalidArgument("reward workers are stopping")
                worker = self._idle.pop() if self._idle else None
            worker = worker or _Worker(self.memory_limit_bytes)
            todo = tasks[len(outcomes):]
            try:
                worker.send(todo)
                for _ in range(len(todo)):
                    outcomes.append(worker.outcome(timeout_s))
            except _Lost as err:  # this sample fails; the worker is gone, the samples after it go to another
                worker.kill()
                task = tasks[len(outcomes)]  # a Run builds the Task here, for its name and index
                error = f"{task.name}: {err}" if err.named else str(err)
                log.warning("%s: sample %d: %s", task.name, task.index, error)
                outcomes.append(ScoreResult(0.0, False, error, {}))
                continue
            except InvalidArgument:
                self._give_back(worker)
                raise
            self._give_back(worker)
        return outcomes

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def close(self) -> None:
        """Kill every idle worker; busy ones are killed as their calls end."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for worker in idle:
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)


def _check_kinds(tasks: Run | list[Task]) -> None:
    if isinstance(tasks, Run):
        return  # a Run builds only the known kinds
    for task in tasks:
        if task.kind not in KINDS:
            raise InvalidArgument(f"task kind must be one of {', '.join(KINDS)}, got {task.kind!r}")


# ----- the worker process -----

def _serve(conn: Connection, memory_limit_bytes: int) -> None:
    """The worker's loop: a run of tasks in, a JSON reply out as each ends, until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the service, which stops its workers
    if memory_limit_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    loop = asyncio.new_event_loop()
    from services.reward import one_sample  # noqa: F401 - imported once, before the first task's clock starts

    conn.send_bytes(b"ready")
    while True:
        try:
            tasks = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        for task in tasks:
            reply = _reply(task, loop)
            plain = reply["kind"] == "ok" and reply["ok"] and not reply["error"] and not reply["scores"]
            conn.send_bytes(PLAIN_REPLY.pack(reply["reward"]) if plain else json.dumps(reply).encode())
            if reply["kind"] == "invalid":  # the request fails: the rest of its run is not scored
                break


def _reply(task: Task, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    from services.reward import one_sample  # already imported by _serve; here for the name

    try:
        if task.request_path:
            one_sample.load_reward_function(task.target)  # InvalidArgument: the request names unusable code
    except InvalidArgument as err:
        return {"kind": "invalid", "error": str(err)[:MAX_ERROR_CHARS]}
    try:
        sample = one_sample.as_sample(task.sample, whole=task.kind == "custom")  # a built-in reads five fields
        value = loop.run_until_complete(one_sample.call_scorer(task.kind, task.target, sample, task.args))
        result = one_sample.to_result(value, task.reward_key, task.name)
        return {"kind": "ok", "reward": result.reward, "ok": result.ok, "error": result.error[:MAX_ERROR_CHARS],
                "scores": result.scores}
    except BaseException as err:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from user code fail the sample
        error = f"{task.name}: {type(err).__name__}: {err}"[:MAX_ERROR_CHARS]
        return {"kind": "ok", "reward": 0.0, "ok": False, "error": error, "scores": {}}
