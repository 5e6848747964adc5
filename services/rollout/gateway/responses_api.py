"""OpenAI Responses on a session: the request's sampling fields, the response object (message and function_call
output items) and the streamed events (response.created ... response.completed) in OpenAI's exact shapes; the
session's responses kept by id for `previous_response_id`."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from services.common.errors import InvalidArgument, PhysarumError
from services.common.samples import Image
from services.rollout.gateway.conversation import Conversation, assistant_message
from services.rollout.gateway.openai_api import _number
from services.rollout.gateway.schema import RequestInvalid
from services.rollout.gateway.sessions import Choice, Prefilled, Session, TurnParams, TurnResult


def params(body: dict[str, Any]) -> TurnParams:
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise RequestInvalid("only 'auto' and 'none' are supported (the model decides)", "tool_choice")
    if ((body.get("text") or {}).get("format") or {"type": "text"}) != {"type": "text"}:
        raise RequestInvalid("only {'type': 'text'} is supported", "text.format")
    if (body.get("reasoning") or {}).get("effort") not in (None, "none"):
        raise RequestInvalid("reasoning is not supported", "reasoning.effort")
    if body.get("top_logprobs"):
        raise RequestInvalid("top_logprobs is not supported", "top_logprobs")
    if body.get("background"):
        raise RequestInvalid("background responses are not supported", "background")
    return TurnParams(max_tokens=_number(body.get("max_output_tokens"), "max_output_tokens", int),
                      temperature=_number(body.get("temperature"), "temperature", float),
                      top_p=_number(body.get("top_p"), "top_p", float))


def history(session: Session, previous_id: str | None) -> tuple[list[dict[str, Any]], list[Image]]:
    """The messages of the session's response `previous_id` (its input and output) and their images, nothing without
    one; an id this session did not answer is refused as OpenAI refuses it."""
    if previous_id is None:
        return [], []
    kept = session.responses.get(previous_id)
    if kept is None:
        raise RequestInvalid(f"Previous response with id '{previous_id}' not found.", "previous_response_id")
    return kept


def keep(session: Session, response_id: str, conversation: Conversation, has_instructions: bool,
         choice: Choice) -> None:
    """Remember the response for a later previous_response_id: its input (without its instructions, which OpenAI
    does not carry over, and hold no image), the assistant turn produced, and the input's images."""
    messages = conversation.messages[1:] if has_instructions else list(conversation.messages)
    session.responses[response_id] = ([*messages, assistant_message(
        choice.content, [(c.name, c.arguments, c.id) for c in choice.tool_calls])], list(conversation.images))


def new_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _function_calls(choice: Choice) -> list[dict[str, Any]]:
    return [{"type": "function_call", "id": f"fc_{c.id.removeprefix('call_')}", "call_id": c.id, "name": c.name,
             "arguments": c.arguments_json, "status": "completed"} for c in choice.tool_calls]


def output(choice: Choice, message_id: str) -> list[dict[str, Any]]:
    """The output items: the text as a message (also when empty and no function is called), then the calls."""
    items = [_message(message_id, choice.content)] if choice.content or not choice.tool_calls else []
    return items + _function_calls(choice)


def response(response_id: str, body: dict[str, Any], model: str, result: TurnResult | None,
             message_id: str = "", created_at: int = 0) -> dict[str, Any]:
    """The response object; `result` None: the in-progress one a stream starts with."""
    choice = result.choices[0] if result is not None else None
    incomplete = choice is not None and choice.finish == "length"
    status = "in_progress" if choice is None else "incomplete" if incomplete else "completed"
    usage = None if result is None else {
        "input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens}
    return {"id": response_id, "object": "response", "created_at": created_at or int(time.time()), "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": model, "output": [] if choice is None else output(choice, message_id or _item_id()),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": body.get("store", True), "temperature": body.get("temperature"),
            "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled", "usage": usage,
            "user": body.get("user"), "metadata": body.get("metadata") or {}}


def _item_id() -> str:
    return f"msg_{secrets.token_hex(16)}"


class _Events:
    """The stream's events, numbered."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **data: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


def _text_end(event: _Events, message_id: str, text: str) -> Iterator[str]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=text,
                logprobs=[])
    yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0, part=part)
    yield event("response.output_item.done", output_index=0, item=_message(message_id, text))


def _text_start(event: _Events, message_id: str) -> Iterator[str]:
    yield event("response.output_item.added", output_index=0, item=_message(message_id, "", "in_progress"))
    yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})


async def live_events(turn: AsyncIterator[Prefilled | str | TurnResult], response_id: str, body: dict[str, Any],
                      model: str, on_result: Any) -> AsyncIterator[str]:
    """The response as OpenAI streams it while it is generated: response.created, response.in_progress, the message
    item whose output_text deltas come as the engine's tokens arrive, each function_call item with its arguments,
    response.completed. `turn`: Session.turn_stream past its first item; on_result(result, message_id) is called
    with the finished turn (to keep the response)."""
    event, message_id, created_at = _Events(), _item_id(), int(time.time())
    opened = False
    try:
        start = response(response_id, body, model, None, created_at=created_at)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        async for item in turn:
            if isinstance(item, Prefilled):  # its cached tokens come with the usage, at the end
                continue
            if isinstance(item, str):
                if not opened:
                    opened = True
                    for line in _text_start(event, message_id):
                        yield line
                yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                            delta=item, logprobs=[])
                continue
            choice = item.choices[0]
            if not opened and (choice.content or not choice.tool_calls):
                opened = True
                for line in _text_start(event, message_id):
                    yield line
            if opened:
                for line in _text_end(event, message_id, choice.content):
                    yield line
            for index, call in enumerate(_function_calls(choice), start=int(opened)):
                yield event("response.output_item.added", output_index=index,
                            item={**call, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                            delta=call["arguments"])
                yield event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                            name=call["name"], arguments=call["arguments"])
                yield event("response.output_item.done", output_index=index, item=call)
            on_result(item, message_id)
            final = response(response_id, body, model, item, message_id, created_at)
            yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                        response=final)
    except PhysarumError as err:  # past the headers: the error comes as an event, as the hosted API sends it
        kind = "invalid_request_error" if isinstance(err, InvalidArgument) else "server_error"
        error = {"message": str(err), "type": kind, "param": None, "code": None}
        yield event("error", code=None, message=str(err), param=None, error=error)
    finally:
        await turn.aclose()
