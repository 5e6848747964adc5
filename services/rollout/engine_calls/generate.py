"""Generating one sample: slime's default `generate` (token in, token out through the router) and what custom
generate functions build on: `router_generate` (the manager's router client, with deadlines, bounded retries, session
routing and abort) and `append_response_tokens` (loss masks and log-probs of multi-turn samples).

A custom function keeps slime's signature, `async def generate(args, sample, sampling_params) -> Sample | list`; it
gets slime's Sample (services/common/plugin_sample.py); `args` is the job spec as a namespace (plus
`sglang_router_ip` / `sglang_router_port`). Knows nothing of the buffer or gRPC.
"""

from __future__ import annotations

import array
import asyncio
import base64
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import types
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from services.common import plugins
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.plugin_sample import START_VERSION_KEY, append_response_tokens, finish_plugin_sample
from services.common.samples import Image, Sample, Status
from services.common.sglang import versioned_adapter_name
from services.rollout.engine_calls.router_http import Poster, PostError, StreamError

log = logging.getLogger(__name__)

STICKY_POLICIES = ("consistent_hashing", "manual")  # router policies that route by X-SMG-Routing-Key
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
EXPECTED = "async def generate(args, sample, sampling_params) -> Sample | list[Sample]"
# the settings that train on the engines' log-probs: a generate function must keep them
LOG_PROB_SETTINGS = ("use_rollout_logprobs", "use_tis")


class _RetryableError(Exception):
    """A /generate attempt that may succeed on another try (engine restarting, request aborted by the engine)."""


def append_reply(sample: Sample, reply: dict[str, Any], trainable: bool = True) -> str:
    """Append a /generate reply's tokens (from meta_info.output_token_logprobs, as slime does) and set the sample's
    status from finish_reason; returns finish_reason.type ("stop", "length" or "abort")."""
    meta = reply.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise FailedPrecondition("a /generate reply without meta_info.output_token_logprobs (send return_logprob)")
    tokens = [int(entry[1]) for entry in entries]
    output_ids = reply.get("output_ids")
    if output_ids is not None and [int(t) for t in output_ids] != tokens:
        raise FailedPrecondition(f"a /generate reply with {len(output_ids)} output_ids that differ from its "
                                 f"{len(tokens)} output_token_logprobs")
    append_response_tokens(sample, tokens, log_probs=[entry[0] for entry in entries] if trainable else None,
                           trainable=trainable, meta_info=meta, text=reply.get("text") or "",
                           update_terminal_info=False)
    if meta.get("routed_experts") is not None:
        set_routed_experts(sample, meta)
    finish = (meta.get("finish_reason") or {}).get("type", "")
    sample.status = Status.from_finish_reason(finish)
    return finish


def set_routed_experts(sample: Sample, meta: dict[str, Any]) -> None:
    """SGLang's meta_info.routed_experts (base64 of int32 [len(tokens) - 1 - routed_experts_start_len, layers,
    top-k], the tokens of the reply appended) onto the sample: the rows before routed_experts_start_len are kept from
    the sample's earlier turns, as slime does."""
    experts = array.array("i", base64.b64decode(meta["routed_experts"]))
    start = int(meta.get("routed_experts_start_len") or 0)
    rows = len(sample.tokens) - 1 - start
    if rows <= 0 or len(experts) % rows:
        raise FailedPrecondition(f"a /generate reply's routed_experts has {len(experts)} entries, not a multiple of "
                                 f"its {rows} tokens (tokens {len(sample.tokens)}, routed_experts_start_len {start})")
    row_size = len(experts) // rows
    kept = list(sample.rollout_routed_experts or [])[:start * row_size]
    if len(kept) != start * row_size:
        raise FailedPrecondition(f"a /generate reply's routed_experts starts at token {start}, but the sample has "
                                 f"routed experts for {len(kept) // row_size} tokens")
    sample.rollout_routed_experts = kept + experts.tolist()


@dataclass
class GenerateContext:
    """How the generate functions of one rollout (or eval) of one job reach the router."""

    http: Poster  # router_http.AiohttpPoster in the manager
    router_url: str
    name: str  # "rollout 3 of job j", for messages
    rid_prefix: str
    sticky_routing: bool = False  # send each sample's session_id as X-SMG-Routing-Key
    max_attempts: int = 5
    retry_delay_s: float = 1.0
    slots: asyncio.Semaphore | None = None  # bounds the requests in flight
    aborting: bool = False  # the manager aborts the rest of the rollout: its batch is full
    version_now: Callable[[], str | None] | None = None  # the pool's settled weight version (recorded per request)
    batch_groups: bool = False  # a group's fresh samples go out as one /generate (default generate function only)
    # opens an agent-gateway session for a sample of this rollout: (session_id, sampling_params, key) -> Session
    open_session: Callable[..., Any] | None = None
    scorer: Any = None  # the rollout's reward-service scorer (scoring.ServiceScorer), for slime's rm_hub.async_rm
    lora_name: str | None = None  # a LoRA job's adapter on the engines: every /generate names it (lora_path)
    lora_versioned: bool = False  # lora_sync disk: the engines hold each version under its own name

    def with_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` naming the job's adapter (SGLang's lora_path), unless it names one itself: under lora_sync disk,
        the version every engine holds (the pool's settled version)."""
        if self.lora_name is None or body.get("lora_path") is not None:
            return body
        version = self.version_now() if self.lora_versioned and self.version_now is not None else None
        name = versioned_adapter_name(self.lora_name, version) if version else self.lora_name
        return {**body, "lora_path": name}

    def record_version(self, meta_info: Any, start_version: str | None) -> None:
        """Stamp a reply's meta_info with the version its request started at; under lora_sync disk that is also the
        version it was generated with (its adapter's name names it), whatever one version the engine reports for
        every adapter (SGLang's, the last job's to sync where jobs share the pool)."""
        if start_version is None or not isinstance(meta_info, dict):
            return
        meta_info[START_VERSION_KEY] = start_version
        if self.lora_versioned and self.lora_name is not None:
            meta_info["weight_version"] = start_version


_CONTEXT: contextvars.ContextVar[GenerateContext] = contextvars.ContextVar("physarum_generate_context")


def use_context(ctx: GenerateContext) -> None:
    """Bind `ctx` to the calling task; tasks it creates afterwards inherit it."""
    _CONTEXT.set(ctx)


def abort_reply(message: str) -> dict[str, Any]:
    """What router_generate returns for a request it did not send because the rollout was aborted."""
    return {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": message},
                                                        "output_token_logprobs": []}}


async def router_generate(sample: Sample, payload: dict[str, Any]) -> dict[str, Any]:
    """POST /generate through the rollout manager's router client and return SGLang's reply.

    Sets a fresh `rid`; sends the sample's session_id as X-SMG-Routing-Key under the consistent_hashing and manual
    router policies (every turn of a sample then reaches the same engine and its prefix cache). Retries, bounded,
    while engines restart or abort requests on their own. Once the manager aborts the rollout it returns the
    engine's abort reply with the partial output (or an empty one if nothing was sent): check
    `reply["meta_info"]["finish_reason"]["type"] == "abort"`. Raises InvalidArgument when the router rejects the
    request (4xx) and Unavailable when every attempt failed.
    """
    ctx = _context()
    session_id = getattr(sample, "session_id", "")
    headers = {ROUTING_KEY_HEADER: session_id} if ctx.sticky_routing and session_id else None

    def body() -> dict[str, Any]:
        return {**payload, "rid": f"{ctx.rid_prefix}-{sample.group_index}-{sample.index}-{uuid.uuid4().hex[:10]}"}

    return await _post_generate(ctx, f"{ctx.name}: prompt {sample.group_index} sample {sample.index}", body, headers,
                                count=None)


async def router_generate_batch(samples: list[Sample], payload: dict[str, Any]) -> list[dict[str, Any]]:
    """router_generate for several samples in one /generate (payload["input_ids"] a list per sample): one reply
    each, in order. No rid (sglang-router takes one string) and no routing key: the batch goes to one engine."""
    ctx = _context()
    what = f"{ctx.name}: prompt {samples[0].group_index} samples {samples[0].index}-{samples[-1].index}"
    replies = await _post_generate(ctx, what, lambda: payload, None, count=len(samples))
    if not isinstance(replies, list) or len(replies) != len(samples):
        got = f"{len(replies)} replies" if isinstance(replies, list) else "one reply"
        raise FailedPrecondition(f"{what}: a /generate batch of {len(samples)} prompts got {got}")
    return replies


async def post_generate(ctx: GenerateContext, what: str, payload: dict[str, Any], *, count: int | None = None,
                        routing_key: str = "") -> Any:
    """/generate through `ctx` from outside a rollout's tasks (the agent gateway's turns): SGLang's reply, or a list
    of `count` replies for a batch of input_ids; the same retries and abort as router_generate. `routing_key` (a
    session's id) goes as X-SMG-Routing-Key under any policy: the router's manual policy keeps a session's turns on
    the engine that holds its prefix; the others ignore it."""
    headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None

    def body() -> dict[str, Any]:
        return payload if count is not None else {**payload, "rid": f"{ctx.rid_prefix}-{uuid.uuid4().hex[:16]}"}

    return await _post_generate(ctx, what, body, headers, count=count)


async def stream_generate(ctx: GenerateContext, what: str, payload: dict[str, Any], *,
                          routing_key: str = "") -> AsyncIterator[dict[str, Any]]:
    """A streamed /generate of one prompt through `ctx`: SGLang's cumulative chunks as they arrive, the last one
    finished. Retries as post_generate does while no chunk has arrived (then it cannot: the caller has them); the
    routing key as post_generate sends it."""
    headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
    last_error = ""
    for attempt in range(1, ctx.max_attempts + 1):
        if ctx.aborting:
            yield abort_reply(f"{ctx.name} was aborted: its batch is full")
            return
        body = ctx.with_adapter({**payload, "stream": True, "rid": f"{ctx.rid_prefix}-{uuid.uuid4().hex[:16]}"})
        start_version = ctx.version_now() if ctx.version_now is not None else None
        num_chunks = 0
        try:
            async with ctx.slots or contextlib.nullcontext():
                async for data in ctx.http.stream(f"{ctx.router_url}/generate", body, headers):
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise InvalidArgument(f"{what}: the engine ended the stream: {chunk['error']}")
                    ctx.record_version(chunk.get("meta_info"), start_version)
                    num_chunks += 1
                    yield chunk
            return
        except StreamError as err:
            if 400 <= err.status_code < 500:
                raise InvalidArgument(f"{what}: router {ctx.router_url} rejected /generate: {err}") from None
            last_error = f"{type(err).__name__}: {err}"
        except PostError as err:
            last_error = f"{type(err).__name__}: {err}"
        if num_chunks:
            raise Unavailable(f"{what}: the /generate stream broke after {num_chunks} chunks: {last_error}")
        if attempt < ctx.max_attempts:
            delay_s = min(ctx.retry_delay_s * 2 ** (attempt - 1), 8.0)
            log.warning("%s: streamed /generate attempt %d/%d failed (%s); retry in %.1f s", what, attempt,
                        ctx.max_attempts, last_error, delay_s)
            await asyncio.sleep(delay_s)
    raise Unavailable(f"{what}: /generate through router {ctx.router_url} failed {ctx.max_attempts} times; "
                      f"last: {last_error}")


def current_context() -> GenerateContext:
    """The rollout's GenerateContext bound to the calling task (a generate function's)."""
    return _context()


def bound_context() -> GenerateContext | None:
    """The rollout's GenerateContext bound to the calling task, or None outside a rollout."""
    return _CONTEXT.get(None)


def _context() -> GenerateContext:
    ctx = _CONTEXT.get(None)
    if ctx is None:
        raise FailedPrecondition("router_generate: called outside a rollout of the rollout manager")
    return ctx


async def _post_generate(ctx: GenerateContext, what: str, body: Callable[[], dict[str, Any]],
                         headers: dict[str, str] | None, count: int | None) -> Any:
    """The attempts of one /generate (a batch of `count` prompts, or one prompt when count is None)."""
    last_error = ""
    for attempt in range(1, ctx.max_attempts + 1):
        try:
            async with ctx.slots or contextlib.nullcontext():
                if ctx.aborting:
                    return _aborted(f"{ctx.name} was aborted: its batch is full", count)
                start_version = ctx.version_now() if ctx.version_now is not None else None
                reply = await ctx.http.post(f"{ctx.router_url}/generate", ctx.with_adapter(body()), headers)
            if 400 <= reply.status_code < 500:
                raise InvalidArgument(f"{what}: router {ctx.router_url} rejected /generate: HTTP {reply.status_code}: "
                                      f"{reply.text[:500]}")
            if reply.status_code >= 500:
                raise _RetryableError(f"HTTP {reply.status_code}: {reply.text[:300]}")
            data = reply.json()
            for one in data if isinstance(data, list) else [data]:
                finish = (one.get("meta_info", {}).get("finish_reason") or {})
                if finish.get("type") == "abort" and not ctx.aborting:
                    raise _RetryableError(f"aborted by the engine: {finish.get('message', '')}")
                ctx.record_version(one.get("meta_info"), start_version)
            return data
        except (PostError, _RetryableError) as err:
            last_error = f"{type(err).__name__}: {err}"
        if ctx.aborting:
            return _aborted(f"{ctx.name} was aborted; last attempt: {last_error}", count)
        if attempt < ctx.max_attempts:
            delay_s = min(ctx.retry_delay_s * 2 ** (attempt - 1), 8.0)
            log.warning("%s: /generate attempt %d/%d failed (%s); retry in %.1f s", what, attempt, ctx.max_attempts,
                        last_error, delay_s)
            await asyncio.sleep(delay_s)
    raise Unavailable(f"{what}: /generate through router {ctx.router_url} failed {ctx.max_attempts} times; "
                      f"last: {last_error}")


def _aborted(message: str, count: int | None) -> Any:
    return abort_reply(message) if count is None else [abort_reply(message) for _ in range(count)]


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's default: one /generate call from sample.tokens, which continues a partial sample with the budget
    left (max_new_tokens minus the response so far)."""
    params = dict(sampling_params)
    params["max_new_tokens"] -= sample.response_length
    if params["max_new_tokens"] <= 0:
        sample.status = Status.TRUNCATED
        return sample
    reply = await router_generate(sample, {"input_ids": list(sample.tokens), "sampling_params": params,
                                           "return_logprob": True, **routed_experts_option(args),
                                           **image_data_option([sample])})
    append_reply(sample, reply)
    return sample


async def generate_fresh_batch(args: Any, samples: list[Sample], sampling_params: dict[str, Any], *,
                               what: str) -> list[Sample]:
    """slime's default `generate` for fresh samples of one prompt (nothing generated yet), as one /generate with a
    batch of input_ids: a request per group instead of one per sample (the manager, the router and the engines
    each handle a request, however many prompts it holds). The samples come back finished as run_generate's do."""
    replies = await router_generate_batch(samples, {"input_ids": [list(s.tokens) for s in samples],
                                                    "sampling_params": dict(sampling_params), "return_logprob": True,
                                                    **routed_experts_option(args), **image_data_option(samples)})
    needs = next((flag for flag in LOG_PROB_SETTINGS if getattr(args, flag, False)), "")
    for sample, reply in zip(samples, replies, strict=True):
        append_reply(sample, reply)
    return [finish_plugin_sample(s, needs_log_probs=needs, what=f"{what}: generate") for s in samples]


def image_data_option(samples: list[Sample]) -> dict[str, Any]:
    """SGLang's image_data for samples whose prompt has images (multimodal_inputs["images"]), each a data: URL: one
    list for one sample, a list per sample for a batch; {} when none has images (a text prompt's body is unchanged)."""
    per_sample = [[image_data_url(i) for i in (getattr(s, "multimodal_inputs", None) or {}).get("images") or []]
                  for s in samples]
    if not any(per_sample):
        return {}
    return {"image_data": per_sample[0] if len(samples) == 1 else per_sample}


def image_data_url(image: Image) -> str:
    return f"data:{image.mime_type};base64,{base64.b64encode(image.data).decode()}"


def routed_experts_option(args: Any) -> dict[str, bool]:
    """SGLang's request option for the experts each token was routed to, when the job replays them (slime's R3)."""
    return {"return_routed_experts": True} if getattr(args, "use_rollout_routing_replay", False) else {}


@functools.cache
def load_generate_function(path: str) -> Callable[..., Any]:
    """The default `generate` for an empty path, else the user's function (its signature checked once)."""
    if not path:
        return generate
    return plugins.load_function(path, flag="custom_generate_function_path", expected=EXPECTED, is_async=True,
                                 num_params=3)


async def run_generate(fn: Callable[..., Any], args: Any, sample: Sample, sampling_params: dict[str, Any], *,
                       evaluation: bool, what: str) -> list[Sample]:
    """Call a generate function (with `evaluation=` when it takes it, as slime does) and check what it returns:
    one sample or a list of them (slime's fan-out), each finished as a core record."""
    kwargs = {"evaluation": evaluation} if "evaluation" in inspect.signature(fn).parameters else {}
    result = await fn(args, sample, dict(sampling_params), **kwargs)
    name = getattr(fn, "__qualname__", str(fn))
    results = result if isinstance(result, list) else [result]
    if not results or not all(isinstance(r, Sample) for r in results):
        got = ", ".join(sorted({type(r).__name__ for r in results})) or "an empty list"
        raise InvalidArgument(f"{what}: generate function {name} returned {got}; expected {EXPECTED}")
    needs = next((flag for flag in LOG_PROB_SETTINGS if getattr(args, flag, False)), "")
    for out in results:  # samples a fan-out built from scratch belong to the same prompt
        out.group_index = sample.group_index if out.group_index is None else out.group_index
        out.index = sample.index if out.index is None else out.index
    return [finish_plugin_sample(r, needs_log_probs=needs, what=f"{what}: generate function {name}")
            for r in results]


def sampling_params(*, temperature: float, top_p: float, top_k: int, max_new_tokens: int, stop: list[str],
                    stop_token_ids: list[int]) -> dict[str, Any]:
    """The sampling_params slime's rollout sends, only keys the router passes through."""
    return {"temperature": temperature, "top_p": top_p, "top_k": top_k if top_k > 0 else -1,
            "max_new_tokens": max_new_tokens, "stop": list(stop), "stop_token_ids": list(stop_token_ids),
            "no_stop_trim": True, "skip_special_tokens": True}


def plugin_args(job_args: dict[str, Any], router_url: str) -> types.SimpleNamespace:
    """slime's `args` for plugins: the job spec, plus where the router is (sglang_router_ip / _port)."""
    url = httpx.URL(router_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    return types.SimpleNamespace(**{**job_args, "sglang_router_ip": url.host, "sglang_router_port": port})


def new_session_id() -> str:
    return uuid.uuid4().hex
