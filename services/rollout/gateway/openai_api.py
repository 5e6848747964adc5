"""OpenAI Chat Completions on a session: the request's sampling fields, the response and the streamed chunks in
OpenAI's exact shapes (chat.completion, chat.completion.chunk, usage)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from services.common.errors import InvalidArgument, PhysarumError
from services.rollout.gateway.sessions import Choice, Prefilled, TurnParams, TurnResult

KNOWN = {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "max_completion_tokens",
         "stop", "n", "logprobs", "top_logprobs", "stream", "stream_options", "parallel_tool_calls", "user", "seed",
         "frequency_penalty", "presence_penalty", "metadata", "store", "response_format"}


def params(body: dict[str, Any]) -> TurnParams:
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise InvalidArgument(f"unsupported fields: {', '.join(unknown)}")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise InvalidArgument("stop: at most 4 non-empty strings")
    if body.get("top_logprobs"):
        raise InvalidArgument("top_logprobs is not supported (logprobs of the chosen tokens are)")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise InvalidArgument("tool_choice: only 'auto' and 'none' are supported (the model decides)")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise InvalidArgument("response_format: only {'type': 'text'} is supported")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return TurnParams(max_tokens=_number(max_tokens, "max_tokens", int), temperature=_number(
        body.get("temperature"), "temperature", float), top_p=_number(body.get("top_p"), "top_p", float),
        stop=stop, n=_number(body.get("n"), "n", int) or 1)


def _number(value: Any, name: str, kind: type) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise InvalidArgument(f"{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    return kind(value)


def _finish(choice: Choice) -> str:
    if choice.finish == "length":
        return "length"
    return "tool_calls" if choice.tool_calls else "stop"


def _tool_calls(choice: Choice) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in choice.tool_calls]


def _logprobs(choice: Choice, decode: Any) -> dict[str, Any]:
    content = []
    for token, logprob in zip(choice.token_ids, choice.log_probs, strict=True):
        text = decode([token])
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


def completion(result: TurnResult, model: str, want_logprobs: bool, decode: Any) -> dict[str, Any]:
    choices = []
    for i, choice in enumerate(result.choices):
        message: dict[str, Any] = {"role": "assistant", "content": choice.content or None, "refusal": None}
        if choice.tool_calls:
            message["tool_calls"] = _tool_calls(choice)
        elif message["content"] is None:
            message["content"] = ""
        choices.append({"index": i, "message": message, "finish_reason": _finish(choice),
                        "logprobs": _logprobs(choice, decode) if want_logprobs else None})
    return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(result), "system_fingerprint": None}


def _usage(result: TurnResult) -> dict[str, Any]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


class _Chunks:
    """chat.completion.chunk events of one completion (one id)."""

    def __init__(self, model: str) -> None:
        self.base = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": model, "system_fingerprint": None}

    def event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return f"data: {json.dumps({**self.base, 'choices': choices, **extra})}\n\n"

    def delta(self, index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> str:
        return self.event([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    def ending(self, index: int, choice: Choice, logprobs: Any) -> Iterator[str]:
        """A choice's tool calls, its log-probs (when asked and not sent with its content), its finish."""
        if logprobs is not None:
            yield self.delta(index, {}, logprobs)
        for j, call in enumerate(_tool_calls(choice)):
            yield self.delta(index, {"tool_calls": [{"index": j, **call}]})
        yield self.delta(index, {}, finish=_finish(choice))


def chunks(result: TurnResult, model: str, want_logprobs: bool, include_usage: bool, decode: Any) -> Iterator[str]:
    """A finished completion as server-sent events (n > 1): per choice a role chunk, its content, its tool calls,
    its finish; then usage if asked; then [DONE]."""
    out = _Chunks(model)
    for i, choice in enumerate(result.choices):
        yield out.delta(i, {"role": "assistant", "content": ""})
        logprobs = _logprobs(choice, decode) if want_logprobs else None
        if choice.content:
            yield out.delta(i, {"content": choice.content}, logprobs)
            logprobs = None
        yield from out.ending(i, choice, logprobs)
    if include_usage:
        yield out.event([], usage=_usage(result))
    yield "data: [DONE]\n\n"


async def live_chunks(turn: AsyncIterator[Prefilled | str | TurnResult], model: str, want_logprobs: bool,
                      include_usage: bool, decode: Any) -> AsyncIterator[str]:
    """A completion as it is generated (n = 1): the role chunk, a content chunk per delta as the engine's tokens
    arrive, then the tool calls, the finish, usage if asked, [DONE]. `turn`: Session.turn_stream past its first
    item."""
    out = _Chunks(model)
    try:
        yield out.delta(0, {"role": "assistant", "content": ""})
        async for item in turn:
            if isinstance(item, Prefilled):  # its cached tokens come with the usage, at the end
                continue
            if isinstance(item, str):
                yield out.delta(0, {"content": item})
                continue
            choice = item.choices[0]
            for event in out.ending(0, choice, _logprobs(choice, decode) if want_logprobs else None):
                yield event
            if include_usage:
                yield out.event([], usage=_usage(item))
        yield "data: [DONE]\n\n"
    except PhysarumError as err:  # past the headers: the error comes as an event, as the hosted API sends it
        kind = "invalid_request_error" if isinstance(err, InvalidArgument) else "server_error"
        yield f"data: {json.dumps({'error': {'message': str(err), 'type': kind, 'param': None, 'code': None}})}\n\n"
    finally:
        await turn.aclose()
