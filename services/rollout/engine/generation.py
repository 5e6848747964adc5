"""The CPU engine's generation core: a scheduler thread that batches waiting requests over a transformers causal LM.

Left-padded prefill, KV-cached decode, per-row sampling and stopping; pause, abort, and an exclusive section in
which weights may change. Knows nothing of HTTP (protocol.py, server.py) or of weight transfer (weights.py).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable

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
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    text: str | None = None
    finish_reason: dict | None = None
    weight_version: str = ""
    created_s: float = field(default_factory=time.monotonic)
    finished_s: float = 0.0
    abort_message: str | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.sampling_seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.sampling_seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def abort_reason(message: str, status_code: int | None = None) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


def sample_next(logits: torch.Tensor, request: Request, rng: torch.Generator,
                eos_ids: frozenset[int]) -> tuple[int, float]:
    """The next token of `request` from its last-position logits [V], with log_softmax(logits / T) at that token.

    T is the request's temperature (1 when greedy at temperature 0), as SGLang reports it; top-k, top-p and min-p
    only restrict which token may be drawn (SGLang's torch sampler).
    """
    p = request.params
    logits = logits.clone()
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(torch.tensor(request.output_ids, dtype=torch.long), minlength=logits.numel())
        counts = counts[: logits.numel()].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.input_ids) | set(request.output_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if len(request.output_ids) < p.min_new_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        logits[torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")
    temperature = 1.0 if p.temperature < 1e-6 else p.temperature
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    if p.greedy:
        token = int(torch.argmax(logits))
    else:
        probs_sorted, order = torch.sort(logprobs.exp(), descending=True)
        cumulative = torch.cumsum(probs_sorted, dim=0)
        if p.top_k > 0:
            probs_sorted[p.top_k:] = 0.0
        probs_sorted[(cumulative - probs_sorted) > p.top_p] = 0.0
        if p.min_p > 0:
            probs_sorted[probs_sorted < probs_sorted[0] * p.min_p] = 0.0
        pick = torch.multinomial(probs_sorted, 1, generator=request.generator or rng)
        token = int(order[pick])
    return token, float(logprobs[token])


def load_model(model_path: str):
    """(model, tokenizer) from a Hugging Face directory: float32, eval mode, no gradients."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return model, tokenizer


def _token_ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple, set)) else {int(value)}


class Engine:
    """Continuous generation over one model: submit requests, they finish on their own (on_finish)."""

    def __init__(self, model, tokenizer, *, max_batch_size: int = 64, seed: int = 0,
                 weight_version: str = "default") -> None:
        self.model = model
        self.tokenizer = tokenizer
        text_config = model.config.get_text_config()
        self.vocab_size: int = text_config.vocab_size
        self.context_len: int = getattr(text_config, "max_position_embeddings", None) or tokenizer.model_max_length
        self.eos_ids = frozenset(_token_ids(text_config.eos_token_id)
                                 | _token_ids(getattr(model.generation_config, "eos_token_id", None)))
        pad = text_config.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids, default=0)
        self.max_batch_size = max_batch_size
        self.tokenizer_lock = threading.Lock()  # a fast tokenizer used from two threads can fail "Already borrowed"
        self.rng = torch.Generator().manual_seed(seed)
        self.weight_version = weight_version
        self.cond = threading.Condition()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.paused = False
        self.parked = False  # the running batch waits between two steps (paused or weights being written)
        self.writing = False
        self.num_writers_waiting = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return list(self.tokenizer(text)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def start(self) -> Engine:
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
                if request.params.max_new_tokens == 0:
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
        request.weight_version = self.weight_version
        request.finished_s = time.monotonic()
        try:
            request.on_finish(request)
        except Exception:  # a broken callback must not stop the scheduler
            log.exception("on_finish of request %s failed", request.rid)

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
                batch = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.max_batch_size))]
                self.running = batch
            try:
                with torch.no_grad():
                    self._run_batch(batch)
            except Exception as err:
                log.exception("batch of %d requests failed", len(batch))
                with self.cond:
                    for request in batch:
                        self._finish(request, abort_reason(f"engine error: {type(err).__name__}: {err}", 500))
            finally:
                with self.cond:
                    self.running = []
                    self.parked = False
                    self.cond.notify_all()

    def _run_batch(self, batch: list[Request]) -> None:
        from transformers import DynamicCache

        size, width = len(batch), max(len(r.input_ids) for r in batch)
        input_ids = torch.full((size, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((size, width), dtype=torch.long)
        for row, request in enumerate(batch):
            input_ids[row, width - len(request.input_ids):] = torch.tensor(request.input_ids, dtype=torch.long)
            mask[row, width - len(request.input_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=DynamicCache(config=self.model.config), use_cache=True, logits_to_keep=1)
        while True:
            logits = out.logits[:, -1, :].float()
            next_ids = torch.full((size, 1), self.pad_id, dtype=torch.long)
            done = []
            for row, request in enumerate(batch):
                if request.finished:
                    continue
                token, logprob = sample_next(logits[row], request, self.rng, self.eos_ids)
                request.output_ids.append(token)
                request.output_logprobs.append(logprob)
                next_ids[row, 0] = token
                reason = self._finish_reason(request)
                if reason is not None:
                    done.append((request, reason))
            if not self._step_boundary(batch, done):
                return
            mask = torch.cat([mask, mask.new_ones((size, 1))], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=next_ids, attention_mask=mask, position_ids=positions,
                             past_key_values=out.past_key_values, use_cache=True)

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
        with self.cond:
            for request, reason in done:
                self._finish(request, reason)
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
