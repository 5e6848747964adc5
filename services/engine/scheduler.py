"""The engine's request scheduling, without torch: a thread that batches waiting requests, pause, abort, stopping
rules, and an exclusive section in which weights may change. What one batch computes is a subclass's `_run_batch`
(generation.py runs a transformers model; fake.py only waits, for control-plane tests and benchmarks).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.engine.prefix_cache import PrefixIndex

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameters that change what is generated (defaults as in SGLang)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


@dataclass(eq=False)
class Request:
    """One sequence to generate; the scheduler fills the outputs and calls `on_finish` once."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_finish: Callable[[Request], None] = lambda request: None
    # a streamed request's: called on the scheduler thread after each step with the number of tokens generated so far
    on_token: Callable[[Request, int], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    text: str | None = None
    finish_reason: dict | None = None
    weight_version: str = ""
    created_s: float = field(default_factory=time.monotonic)
    finished_s: float = 0.0
    abort_message: str | None = None
    generator: Any = None  # the request's own RNG when it has a sampling_seed (made by the engine that samples)
    return_routed_experts: bool = False
    # int32 [tokens fed so far, num_layers, top_k] as bytes, when asked for (SGLang's routed_experts)
    routed_experts: bytearray = field(default_factory=bytearray)
    # SGLang's logprob_start_len: >= 0 asks for the log-prob of each input token from there (the first token has
    # none); the engine scores the whole input before generating (a teacher's prefill-only call: max_new_tokens 0)
    logprob_start_len: int = -1
    input_logprobs: list[float | None] | None = None
    images: Any = None  # a prompt with images: what the engine's model reads of them (vision.PromptImages)
    lora_name: str | None = None  # SGLang's lora_path: the loaded adapter it is generated with (None: the base)
    cached_tokens: int = 0  # leading input tokens computed before (SGLang's meta_info.cached_tokens)

    @property
    def scores_input(self) -> bool:
        return self.logprob_start_len >= 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def token_id_set(value) -> set[int]:
    """Token ids from a config's eos_token_id: None, one id, or a list of ids."""
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple, set)) else {int(value)}


def abort_reason(message: str, status_code: int | None = None) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


class Scheduler:
    """Continuous generation: submit requests, they finish on their own (on_finish). Subclasses compute batches."""

    def __init__(self, *, vocab_size: int, context_len: int, eos_ids: frozenset[int], max_batch_size: int = 64,
                 weight_version: str = "default", per_token_delay_s: float = 0.0) -> None:
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.eos_ids = eos_ids
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.per_token_delay_s = per_token_delay_s  # added to every decode step (latency-controlled tests)
        self.max_loras_per_batch = 0  # > 0 (LoRA serving): most distinct adapters in a batch, the base counting
        self.routes_experts = False  # whether it reports the experts an MoE model routed each token to
        self.vision: Any = None  # a vision-language model's image side (vision.Vision); None: it takes no images
        self.last_progress_s = time.monotonic()  # the last time any request got a token or finished
        self.cond = threading.Condition()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.paused = False
        self.parked = False  # the running batch waits between two steps (paused or weights being written)
        self.writing = False
        self.num_writers_waiting = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self.prefix_index = PrefixIndex()
        self.prefix_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        raise NotImplementedError

    def _run_batch(self, batch: list[Request]) -> None:
        """Generate until every request of `batch` finished, calling `_step_boundary` after each token."""
        raise NotImplementedError

    def _score_inputs(self, requests: list[Request]) -> None:
        """Set each request's input_logprobs: the log-prob of every input token from logprob_start_len on (None
        for the first token, which nothing precedes), at the request's temperature."""
        raise NotImplementedError

    def _prefill_only(self, batch: list[Request]) -> list[Request]:
        """Score the inputs that asked for it, finish those that generate nothing; the requests left to generate."""
        scoring = [r for r in batch if r.scores_input and not r.finished]
        if scoring:
            self._score_inputs(scoring)
        with self.cond:
            for request in scoring:
                if request.params.max_new_tokens == 0:
                    self._finish(request, {"type": "length", "length": 0})
        return [r for r in batch if not r.finished]

    def start(self) -> Scheduler:
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        with self.cond:
            self.stopping = True
            self._abort_locked(lambda r: True, "engine shutting down")
        self.thread.join(timeout_s)

    # -- requests ---------------------------------------------------------------------------------------

    def submit(self, requests: list[Request]) -> None:
        with self.cond:
            if self.stopping:
                raise Unavailable("engine is shutting down")
            for request in requests:
                # an image's tokens stand for pixels, an adapter's KV is not the base's: no comparable prefix
                if not request.images and request.lora_name is None:
                    with self.prefix_lock:
                        request.cached_tokens = self.prefix_index.match(request.input_ids, self.weight_version)
                if request.params.max_new_tokens == 0 and not request.scores_input:
                    self._finish(request, {"type": "length", "length": 0})
                else:
                    self.waiting.append(request)
            self.cond.notify_all()

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Abort request") -> int:
        """Finish matching requests as aborted: queued ones now, running ones at the next step. Returns the count.

        A rid also matches the `rid_<j>` copies of a request with n > 1.
        """
        if not (rid or abort_all):
            return 0
        with self.cond:
            return self._abort_locked(lambda r: abort_all or r.rid == rid or r.rid.startswith(f"{rid}_"), message)

    def abort_adapter(self, lora_name: str, message: str) -> int:
        """Finish every request generated with adapter `lora_name` as aborted (it is being unloaded)."""
        with self.cond:
            return self._abort_locked(lambda r: r.lora_name == lora_name, message)

    def drain_adapter(self, lora_name: str, timeout_s: float) -> int:
        """Wait up to timeout_s for the requests generated with adapter `lora_name` to finish; returns how many are
        still queued or running then."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                left = sum(r.lora_name == lora_name for r in self.waiting) + \
                    sum(not r.finished and r.lora_name == lora_name for r in self.running)
                if not left or time.monotonic() >= deadline:
                    return left
                self.cond.wait(min(0.05, max(deadline - time.monotonic(), 0.0)))

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        with self.cond:
            return sum(not r.finished for r in self.running), len(self.waiting)

    def _abort_locked(self, match: Callable[[Request], bool], message: str) -> int:
        queued = [r for r in self.waiting if match(r)]
        for request in queued:
            self.waiting.remove(request)
            self._finish(request, abort_reason(message))
        running = [r for r in self.running if not r.finished and match(r)]
        for request in running:
            request.abort_message = message
        self.cond.notify_all()
        return len(queued) + len(running)

    def _finish(self, request: Request, reason: dict) -> None:
        if request.finished:
            return
        if request.text is None:
            request.text = self.decode(request.output_ids, request.params.skip_special_tokens)
        request.finish_reason = reason
        request.weight_version = self._weight_version_of(request)
        computed = request.output_ids or request.scores_input  # else it finished before any prefill
        # the index holds the base model's sequences (an adapter's KV differs); the last output was never fed back
        if reason.get("type") != "abort" and computed and not request.images and request.lora_name is None:
            with self.prefix_lock:
                self.prefix_index.insert(request.input_ids + request.output_ids[:-1], self.weight_version)
        request.finished_s = self.last_progress_s = time.monotonic()
        try:
            request.on_finish(request)
        except Exception:  # a broken callback must not stop the scheduler
            log.exception("on_finish of request %s failed", request.rid)

    def _weight_version_of(self, request: Request) -> str:
        """The weight version `request` was generated with (an adapter's own, under LoRA serving)."""
        return self.weight_version

    @staticmethod
    def _notify_token(request: Request) -> None:
        try:
            request.on_token(request, len(request.output_ids))
        except Exception:  # a broken callback must not stop the scheduler
            log.exception("on_token of request %s failed", request.rid)

    # -- pause, continue, exclusive access for weight updates --------------------------------------------

    def pause(self, mode: str, timeout_s: float) -> None:
        """Stop scheduling; `abort` also aborts every request, `in_place`/`retract` keep them waiting.

        Returns once no batch is computing (it finished or waits between two steps).
        """
        if mode not in PAUSE_MODES:
            raise InvalidArgument(f"pause_generation: mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        with self.cond:
            self.paused = True
            if mode == "abort":
                self._abort_locked(lambda r: True, "Abort by pause_generation")
            if not self.cond.wait_for(lambda: not self.running or self.parked, timeout_s):
                raise DeadlineExceeded(f"pause_generation: the running batch did not stop in {timeout_s} s")

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    @property
    def is_paused(self) -> bool:
        return self.paused

    @contextlib.contextmanager
    def exclusive(self, timeout_s: float) -> Iterator[None]:
        """Hold the model alone: waits for the running batch to finish unless it is paused between two steps."""
        with self.cond:
            self.num_writers_waiting += 1
            try:
                ready = self.cond.wait_for(lambda: not self.writing and (not self.running or self.parked), timeout_s)
            finally:
                self.num_writers_waiting -= 1
            if not ready:
                raise DeadlineExceeded(f"running requests did not finish in {timeout_s} s; pause generation first")
            self.writing = True
        try:
            yield
        finally:
            with self.cond:
                self.writing = False
                self.cond.notify_all()

    # -- the scheduler -------------------------------------------------------------------------------------

    def _can_start_batch(self) -> bool:
        return bool(self.waiting) and not (self.paused or self.writing or self.num_writers_waiting)

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stopping or self._can_start_batch())
                if self.stopping:
                    return
                batch = self._take([], self.max_batch_size, stop_at_scoring=False)
                self.running = batch
            try:
                todo = self._prefill_only(batch)
                if todo:
                    self._run_batch(todo)
            except Exception as err:
                log.exception("batch of %d requests failed", len(batch))
                with self.cond:
                    for request in [*batch, *self.running]:  # running: with the requests that joined the batch
                        self._finish(request, abort_reason(f"engine error: {type(err).__name__}: {err}", 500))
            finally:
                with self.cond:
                    self.running = []
                    self.parked = False
                    self.cond.notify_all()

    def _admit(self, batch: list[Request]) -> list[Request]:
        """Waiting requests that join the running `batch` at this step boundary (continuous batching), as many as fit
        under max_batch_size and `_worth_joining` allows; none while paused or while weights change. Sets
        `self.running` to the rows still running, then the joined ones."""
        with self.cond:
            active = [r for r in batch if not r.finished]
            if not self._can_start_batch() or len(active) >= self.max_batch_size:
                return []
            # a request that scores its input starts a batch of its own (`_prefill_only`)
            joining = self._take(active, self.max_batch_size - len(active), stop_at_scoring=True, dry_run=True)
            if not joining or not self._worth_joining(active, joining):
                return []
            for request in joining:
                self.waiting.remove(request)
            self.running = active + joining
            return joining

    def _take(self, batch: list[Request], limit: int, *, stop_at_scoring: bool, dry_run: bool = False
              ) -> list[Request]:
        """Up to `limit` waiting requests, in order, that may join `batch`: with max_loras_per_batch set, a request
        whose adapter would be one too many waits for a later batch (those behind it may go first). Removed from
        the queue unless `dry_run`."""
        names = {r.lora_name for r in batch}
        taken: list[Request] = []
        for request in self.waiting:
            if len(taken) >= limit or (stop_at_scoring and request.scores_input):
                break
            if self.max_loras_per_batch and request.lora_name not in names:
                if len(names) >= self.max_loras_per_batch:
                    continue
                names.add(request.lora_name)
            taken.append(request)
        if not dry_run:
            for request in taken:
                self.waiting.remove(request)
        return taken

    def _worth_joining(self, active: list[Request], joining: list[Request]) -> bool:
        """Whether `joining` should join the running rows `active` now rather than wait for the batch to end."""
        return True

    def _finish_reason(self, request: Request) -> dict | None:
        """Why `request` stops after its last token, in SGLang's order of checks; None to go on."""
        p, token, count = request.params, request.output_ids[-1], len(request.output_ids)
        if count >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return {"type": "stop", "matched": token}
        if p.stop:
            text = self.decode(request.output_ids, p.skip_special_tokens)
            found = [(text.find(s), s) for s in p.stop if s and s in text]
            if found:
                index, matched = min(found)
                request.text = text if p.no_stop_trim else text[:index]
                return {"type": "stop", "matched": matched}
        if len(request.input_ids) + count >= self.context_len:
            return {"type": "length", "length": count}
        return None

    def _step_boundary(self, batch: list[Request], done: list[tuple[Request, dict]]) -> bool:
        """Finish rows, apply aborts, wait while paused or while weights change; False once every row finished."""
        if self.per_token_delay_s:
            time.sleep(self.per_token_delay_s)
        with self.cond:
            self.last_progress_s = time.monotonic()
            for request, reason in done:
                self._finish(request, reason)
            for request in batch:
                if request.on_token is not None and not request.finished:
                    self._notify_token(request)
            try:
                while True:
                    for request in batch:
                        if request.abort_message is not None:
                            self._finish(request, abort_reason(request.abort_message))
                    if all(r.finished for r in batch):
                        return False
                    if not (self.paused or self.writing):
                        return True
                    self.parked = True
                    self.cond.notify_all()
                    self.cond.wait()
            finally:
                self.parked = False
