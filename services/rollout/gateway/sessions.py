"""Sessions and their turns: a session is one sample, opened by the rollout manager, reached by its own API key; a
turn renders what is new, generates through the router, parses tool calls and records the exact tokens.
Knows nothing of the APIs' wire shapes (openai_api.py, responses_api.py, anthropic_api.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, PhysarumError, Unavailable
from services.common.plugin_sample import START_VERSION_KEY
from services.common.samples import Image
from services.rollout.engine_calls.generate import GenerateContext, image_data_url, post_generate, stream_generate
from services.rollout.gateway.conversation import Conversation, Limits, assistant_message
from services.rollout.gateway.deltas import ContentDeltas
from services.rollout.gateway.metrics import GatewayMetrics
from services.rollout.gateway.toolcalls import ToolCall, parse_tool_calls
from services.rollout.gateway.trajectory import Renderer, Trajectory

log = logging.getLogger(__name__)

END_OF_TURN_TOKENS = ("<|im_end|>",)  # Qwen/Hermes templates close a turn here: the engine stops at it


class SessionClosed(FailedPrecondition):
    """The session has ended (its sample is being scored) or was aborted."""


@contextlib.contextmanager
def _engine_errors(session_id: str) -> Iterator[None]:
    """The engines' and the router's errors, logged in full and answered in general terms: their texts name internal
    addresses and the job, which are not the agent's business."""
    try:
        yield
    except PhysarumError as err:
        log.warning("gateway session %s: %s", session_id, err)
        if isinstance(err, InvalidArgument):
            raise InvalidArgument("the model server refused this request (its prompt and max_tokens must fit the "
                                  "model's context; its sampling fields must be in range)") from None
        if isinstance(err, Unavailable) and "aborted" in str(err):
            raise Unavailable("the rollout was aborted (its batch is full or the weights are changing); end the "
                              "episode") from None
        raise Unavailable("no model server answered this turn; retry it") from None


def _cached_tokens(reply: dict) -> int:
    """The prompt tokens the engine found in its prefix cache (SGLang's meta_info.cached_tokens; 0 if unsaid)."""
    return int((reply.get("meta_info") or {}).get("cached_tokens") or 0)


@dataclass
class TurnParams:
    """One request's sampling, in the API-neutral form."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1


@dataclass
class Choice:
    content: str
    tool_calls: list[ToolCall]
    finish: str  # stop, length
    matched_stop: str | None  # the request's stop string that ended it
    token_ids: list[int]
    log_probs: list[float]


@dataclass(frozen=True)
class Prefilled:
    """A streamed turn's prompt as the engine's first chunk reported it: how much of it the engine's prefix cache
    held (its meta_info.cached_tokens), known before any token of the reply."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class TurnResult:
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    branched: str  # why this turn started a branch ("" if it did not)
    cached_tokens: int = 0  # of the prompt, found in the engine's prefix cache (its meta_info.cached_tokens)


@dataclass
class Session:
    id: str
    key: str
    ctx: GenerateContext
    renderer: Renderer
    sampling_params: dict[str, Any]  # the job's; max_new_tokens is the session's response budget
    limits: Limits
    metrics: GatewayMetrics
    model: str = "physarum"
    trajectory: Trajectory = field(init=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reward: float | None = None
    closed: bool = False
    aborted: bool = False
    num_turns: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    registry: SessionRegistry | None = None  # the registry that opened it (closes it)
    gateway_url: str = ""  # where agents reach the gateway (its root), when the manager serves one
    context_len: int | None = None  # the model's context in tokens, when its config names it
    # Responses API ids: their messages and those messages' images
    responses: dict[str, tuple[list[dict[str, Any]], list[Image]]] = field(default_factory=dict)
    parent: Session | None = None  # the session that spawned this one (a sub-agent's, a restart's)
    children: list[Session] = field(default_factory=list)  # the sessions spawned from this one, in order
    takes_images: bool = True  # False for a job that trains on text (no multimodal_keys): images are refused

    def __post_init__(self) -> None:
        self.trajectory = Trajectory(self.renderer)

    async def _prepare_off_loop(self, conversation: Conversation, params: TurnParams) -> tuple[Any, int]:
        """_prepare in the registry's worker pool: rendering and tokenizing are no work for the event loop."""
        if self.registry is None:
            return self._prepare(conversation, params)
        return await self.registry.in_pool(self._prepare, conversation, params)

    async def turn(self, conversation: Conversation, params: TurnParams) -> TurnResult:
        """Generate the next assistant turn for `conversation` (one per choice); InvalidArgument past a bound."""
        async with self.lock:
            start_s = time.monotonic()
            prepared, max_new_tokens = await self._prepare_off_loop(conversation, params)
            with _engine_errors(self.id):
                replies = await self._generate(prepared, params, max_new_tokens)
            return self._finish(prepared, conversation, replies, params, start_s)

    async def turn_stream(self, conversation: Conversation,
                          params: TurnParams) -> AsyncIterator[int | Prefilled | str | TurnResult]:
        """The turn as it is generated (n = 1): first the prompt's token count, then Prefilled once the engine's first
        chunk arrives, then content deltas as the engine's tokens arrive, last the TurnResult (whose content the
        deltas joined begin; tool calls come only with it). Bounds are checked before the first item."""
        async with self.lock:
            start_s = time.monotonic()
            prepared, max_new_tokens = await self._prepare_off_loop(conversation, params)
            yield len(prepared.input_ids)
            deltas = ContentDeltas(params.stop, bool(conversation.tools))
            what = f"{self.ctx.name}: gateway session {self.id} turn {self.num_turns}"
            last: dict = {}
            prefilled = False
            with _engine_errors(self.id):
                async for last in stream_generate(self.ctx, what, self._payload(prepared, params, max_new_tokens),
                                                  routing_key=self.id):
                    if not prefilled:
                        prefilled = True
                        yield Prefilled(len(prepared.input_ids), _cached_tokens(last))
                    entries = (last.get("meta_info") or {}).get("output_token_logprobs") or []
                    if delta := deltas.update(self.renderer.decode([int(e[1]) for e in entries])):
                        yield delta
                checked = self._checked(last, what)
            result = self._finish(prepared, conversation, [checked], params, start_s)
            if rest := deltas.finish(result.choices[0].content):
                yield rest
            yield result

    def _prepare(self, conversation: Conversation, params: TurnParams) -> tuple[Any, int]:
        """Check the bounds, match the history: what to generate from and the most new tokens (the lock held)."""
        if self.closed:
            raise SessionClosed(f"session {self.id} has ended; its sample is being scored")
        if self.num_turns >= self.limits.max_turns:
            raise InvalidArgument(f"session {self.id}: {self.num_turns} turns, at most {self.limits.max_turns} "
                                  "per session")
        if not 1 <= params.n <= self.limits.max_choices:
            raise InvalidArgument(f"n must be in [1, {self.limits.max_choices}], got {params.n}")
        if conversation.images and not self.takes_images:
            raise InvalidArgument(f"messages: {len(conversation.images)} images, but this session's job trains on "
                                  "text (it sets no multimodal_keys)")
        prepared = self.trajectory.prepare(conversation, self.context_len)
        root = prepared.parent.path()[0] if prepared.parent is not None else None
        used = len(prepared.input_ids) - (len(root.context) if root is not None else len(prepared.input_ids))
        budget = int(self.sampling_params["max_new_tokens"]) - used
        if budget <= 0:
            limit = self.sampling_params["max_new_tokens"]
            raise InvalidArgument(f"session {self.id}: its response budget of {limit} tokens is spent ({used} "
                                  "used); finish the episode")
        if params.max_tokens is not None and params.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {params.max_tokens}")
        return prepared, min(budget, params.max_tokens or budget)

    def _finish(self, prepared: Any, conversation: Conversation, replies: list[dict], params: TurnParams,
                start_s: float) -> TurnResult:
        """Record the engine's replies as the turn's choices, count them (the lock held)."""
        self.num_turns += 1
        choices = [self._record(prepared, conversation, reply, params, make_tip=i == 0)
                   for i, reply in enumerate(replies)]
        if prepared.branch_reason:
            self.metrics.branches.inc()
            log.info("session %s: turn %d starts a branch: %s", self.id, self.trajectory.tip.index,
                     prepared.branch_reason)
        completion = sum(len(c.token_ids) for c in choices)
        self.metrics.turns.inc()
        self.metrics.prompt_tokens.inc(len(prepared.input_ids))
        self.metrics.completion_tokens.inc(completion)
        self.metrics.turn_seconds.observe(time.monotonic() - start_s)
        cached = _cached_tokens(replies[0])
        self.metrics.cached_tokens.inc(cached)
        return TurnResult(choices, len(prepared.input_ids), completion, prepared.branch_reason, cached)

    def _payload(self, prepared: Any, params: TurnParams, max_new_tokens: int) -> dict[str, Any]:
        """The /generate body: the prompt's tokens (its image tokens expanded) and, when it has images, every one of
        them as SGLang's image_data (one list per prompt of a batch of n)."""
        input_ids = prepared.input_ids
        sampling = dict(self.sampling_params, max_new_tokens=max_new_tokens)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(params, name) is not None:
                sampling[name] = getattr(params, name)
        sampling["stop"] = [*sampling.get("stop", []), *params.stop]
        sampling["stop_token_ids"] = sorted({*sampling.get("stop_token_ids", []), *self.stop_token_ids})
        body = {"input_ids": input_ids if params.n == 1 else [input_ids] * params.n, "sampling_params": sampling,
                "return_logprob": True}
        if prepared.all_images:
            urls = [image_data_url(image) for image in prepared.all_images]
            body["image_data"] = urls if params.n == 1 else [urls] * params.n
        return body

    def _checked(self, reply: dict, what: str) -> dict:
        """The reply, unless the engine or the manager aborted it (Unavailable) or it never finished."""
        finish = (reply.get("meta_info") or {}).get("finish_reason") or {}
        if finish.get("type") == "abort":
            self.aborted = True
            raise Unavailable(f"{what}: the rollout was aborted (its batch is full or the weights are changing)")
        if not finish:
            raise Unavailable(f"{what}: the /generate stream ended before its last chunk")
        return reply

    async def _generate(self, prepared: Any, params: TurnParams, max_new_tokens: int) -> list[dict]:
        what = f"{self.ctx.name}: gateway session {self.id} turn {self.num_turns}"
        data = await post_generate(self.ctx, what, self._payload(prepared, params, max_new_tokens),
                                   count=None if params.n == 1 else params.n, routing_key=self.id)
        replies = data if isinstance(data, list) else [data]
        if len(replies) != params.n:
            raise FailedPrecondition(f"{what}: {params.n} choices asked, {len(replies)} replies")
        return [self._checked(reply, what) for reply in replies]

    def _record(self, prepared: Any, conversation: Conversation, reply: dict, params: TurnParams,
                make_tip: bool) -> Choice:
        meta = reply.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        token_ids = [int(e[1]) for e in entries]
        log_probs = [float(e[0]) for e in entries]
        finish_reason = meta.get("finish_reason") or {}
        finish = "length" if finish_reason.get("type") == "length" else "stop"
        text = self.renderer.decode(token_ids)
        matched = finish_reason.get("matched") if isinstance(finish_reason.get("matched"), str) else None
        if matched is not None and matched in text:
            text = text[:text.index(matched)]
        content, calls = parse_tool_calls(text, conversation.tool_names) if conversation.tools else (text.strip(), [])
        end, start = meta.get("weight_version"), meta.get(START_VERSION_KEY)
        versions = [str(v) for v in (start, end) if v is not None]
        assistant = assistant_message(content, [(c.name, c.arguments, c.id) for c in calls])
        self.trajectory.record(prepared, conversation, assistant, token_ids, log_probs, versions,
                               finish_reason.get("type", ""), make_tip)
        return Choice(content, calls, finish, matched if matched in params.stop else None, token_ids, log_probs)


class SessionRegistry:
    """The open sessions, by key; the rollout manager opens and closes them."""

    def __init__(self, limits: Limits | None = None, metrics: GatewayMetrics | None = None, workers: int = 4) -> None:
        self.limits = limits or Limits()
        self.metrics = metrics or GatewayMetrics()
        self._by_key: dict[str, Session] = {}
        if workers < 1:
            raise ValueError(f"gateway workers must be >= 1, got {workers}")
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="gateway")  # parsing, rendering, tokenizing

    async def in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in the worker pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def open(self, ctx: GenerateContext, renderer: Any, sampling_params: dict[str, Any], *, session_id: str,
             model: str = "physarum", key: str = "", images: bool = True) -> Session:
        """A new session; its key is a fresh secret unless `key` is given (slime's adapters use the session id);
        `images`: whether its requests may hold images (a job that trains on them)."""
        if key and key in self._by_key:
            raise InvalidArgument(f"session key {key[:8]}...: a session with this key is open")
        tokenizer = getattr(renderer, "tokenizer", None)
        stop_ids = [] if tokenizer is None else [i for token in END_OF_TURN_TOKENS
                                                 if (i := tokenizer.token_to_id(token)) is not None]
        session = Session(id=session_id, key=key or f"sk-physarum-{secrets.token_urlsafe(24)}", ctx=ctx,
                          renderer=renderer, sampling_params=dict(sampling_params), limits=self.limits,
                          metrics=self.metrics, model=model, stop_token_ids=stop_ids, registry=self,
                          context_len=getattr(renderer, "context_len", None), takes_images=images)
        self._by_key[session.key] = session
        self.metrics.sessions_open.inc()
        return session

    def spawn(self, session: Session) -> Session:
        """A new session for the same sample (a sub-agent, or the agent starting over): its own key and trajectory,
        the same job settings; it becomes a sample of its own in the prompt's group and closes with the first."""
        root = session.parent or session
        if root.closed:
            raise SessionClosed(f"session {root.id} has ended; its sample is being scored")
        if len(root.children) >= self.limits.max_spawned:
            raise InvalidArgument(f"session {root.id}: {len(root.children)} sessions spawned, at most "
                                  f"{self.limits.max_spawned} per sample")
        child = self.open(root.ctx, root.renderer, root.sampling_params,
                          session_id=f"{root.id}-{len(root.children) + 1}", model=root.model,
                          images=root.takes_images)
        child.parent, child.gateway_url = root, root.gateway_url
        root.children.append(child)
        return child

    def by_id(self, session_id: str) -> Session | None:
        return next((s for s in self._by_key.values() if s.id == session_id), None)

    def by_key(self, key: str) -> Session:
        session = self._by_key.get(key) if key else None
        if session is None:
            raise NotFound("no open session has this API key")
        return session

    def close(self, session: Session) -> None:
        """End the session and those it spawned: later requests with their keys get 401; a turn running now
        finishes first."""
        for child in session.children:
            self.close(child)
        session.closed = True
        if self._by_key.pop(session.key, None) is not None:
            self.metrics.sessions_open.dec()

    def __len__(self) -> int:
        return len(self._by_key)
