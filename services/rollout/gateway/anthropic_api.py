"""Anthropic Messages on a session: the request's sampling fields, the response and the streamed events in
Anthropic's exact shapes (message, content blocks text / tool_use, stop_reason, usage)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

from services.common.errors import InvalidArgument, PhysarumError
from services.rollout.gateway.openai_api import _number
from services.rollout.gateway.sessions import Choice, Prefilled, TurnParams, TurnResult

# temperature / top_p / top_k: older clients send them (the current API dropped them); the rest has no effect here
KNOWN = {"model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k",
         "stop_sequences", "stream", "metadata", "thinking", "service_tier", "cache_control", "speed", "inference_geo",
         "diagnostics", "user_profile_id", "workspace_id", "output_config"}
OUTPUT_CONFIG = {"effort"}  # Claude Code sends output_config.effort; a hint with no effect here, like `speed`
# Claude Code asks for adaptive thinking; as on a hosted model without extended thinking, a request for it is served
# without thinking blocks (a reasoning model's reasoning stays in its text)
THINKING = {"disabled", "enabled", "adaptive"}


def params(body: dict[str, Any]) -> TurnParams:
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise InvalidArgument(f"unsupported fields: {', '.join(unknown)}")
    if "max_tokens" not in body:
        raise InvalidArgument("max_tokens: Field required")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8:
        raise InvalidArgument("stop_sequences: at most 8 non-empty strings")
    choice = body.get("tool_choice")
    if choice is not None and (not isinstance(choice, dict) or choice.get("type") not in ("auto", "none")):
        raise InvalidArgument("tool_choice: only {'type': 'auto'} and {'type': 'none'} are supported")
    output_config = body.get("output_config") or {}
    if not isinstance(output_config, dict) or set(output_config) - OUTPUT_CONFIG:
        raise InvalidArgument("output_config: only 'effort' is supported (structured output formats are not)")
    if (body.get("thinking") or {}).get("type", "disabled") not in THINKING:
        raise InvalidArgument(f"thinking.type: one of {', '.join(sorted(THINKING))}")
    return TurnParams(max_tokens=_number(body["max_tokens"], "max_tokens", int),
                      temperature=_number(body.get("temperature"), "temperature", float),
                      top_p=_number(body.get("top_p"), "top_p", float), top_k=_number(body.get("top_k"), "top_k", int),
                      stop=stop)


def _stop_reason(choice: Choice) -> str:
    if choice.finish == "length":
        return "max_tokens"
    if choice.tool_calls:
        return "tool_use"
    return "stop_sequence" if choice.matched_stop else "end_turn"


def _blocks(choice: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": choice.content}] if choice.content else []
    blocks += [{"type": "tool_use", "id": f"toolu_{c.id.removeprefix('call_')}", "name": c.name, "input": c.arguments}
               for c in choice.tool_calls]
    return blocks


def message(result: TurnResult, model: str) -> dict[str, Any]:
    choice = result.choices[0]
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": model,
            "content": _blocks(choice), "stop_reason": _stop_reason(choice), "stop_sequence": choice.matched_stop,
            "usage": usage(result.prompt_tokens, result.cached_tokens, result.completion_tokens)}


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage, whose three input counts add up to the prompt: input_tokens those not read from the cache,
    cache_read_input_tokens those the engine's prefix cache held (its meta_info.cached_tokens). The engine caches
    every prompt by itself, with no cache_control breakpoint, so none count as written to the cache (as an
    automatic prefix cache reports them)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def _start(model: str, prompt_tokens: int, cached_tokens: int) -> str:
    return _event("message_start", message={"id": f"msg_{secrets.token_hex(12)}", "type": "message",
                                            "role": "assistant", "model": model, "content": [], "stop_reason": None,
                                            "stop_sequence": None, "usage": usage(prompt_tokens, cached_tokens, 0)})


def _tool_blocks(blocks: list[dict[str, Any]], first_index: int) -> Iterator[str]:
    for i, block in enumerate(blocks, start=first_index):
        yield _event("content_block_start", index=i, content_block={**block, "input": {}})
        yield _event("content_block_delta", index=i,
                     delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield _event("content_block_stop", index=i)


def _end(result: TurnResult) -> Iterator[str]:
    choice = result.choices[0]
    yield _event("message_delta", delta={"stop_reason": _stop_reason(choice), "stop_sequence": choice.matched_stop},
                 usage=usage(result.prompt_tokens, result.cached_tokens, result.completion_tokens))
    yield _event("message_stop")


async def live_events(turn: AsyncIterator[Prefilled | str | TurnResult], prompt_tokens: int,
                      model: str) -> AsyncIterator[str]:
    """The message as Anthropic's stream while it is generated: message_start (once the engine's first chunk says
    how much of the prompt its cache held), a text block whose deltas come as the engine's tokens arrive, the
    tool_use blocks, message_delta (with the whole usage), message_stop. `turn`: Session.turn_stream past its first
    item (the prompt's token count)."""
    num_blocks, started = 0, False
    try:
        async for item in turn:
            if not started:
                started = True
                cached = item.cached_tokens if isinstance(item, (Prefilled, TurnResult)) else 0
                yield _start(model, prompt_tokens, cached)
            if isinstance(item, Prefilled):
                continue
            if isinstance(item, str):
                if not num_blocks:
                    num_blocks = 1
                    yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": item})
                continue
            if num_blocks:
                yield _event("content_block_stop", index=0)
            for event in _tool_blocks([b for b in _blocks(item.choices[0]) if b["type"] == "tool_use"], num_blocks):
                yield event
            for event in _end(item):
                yield event
    except PhysarumError as err:  # past the headers: the error comes as an event, as the hosted API sends it
        kind = "invalid_request_error" if isinstance(err, InvalidArgument) else "overloaded_error"
        yield _event("error", error={"type": kind, "message": str(err)})
    finally:
        await turn.aclose()
