"""The APIs' requests as one conversation: messages in the form chat templates read (OpenAI's, with tool-call
arguments as objects) plus the tools, checked and bounded; and each message's canonical key, which is how a
history sent back is matched to the turns the gateway produced. The images of a user message or a tool's result
(OpenAI `image_url` parts, Responses `input_image` parts, Anthropic `image` blocks, as base64 data) become image
parts of its content, each decoded and checked here once; the conversation lists them in order. Knows nothing of
tokens or HTTP.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidArgument
from services.common.images import check_image, data_url_image, decode_base64
from services.common.samples import Image
from services.rollout.gateway.schema import RequestInvalid, check_json_schema

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Limits:
    """What one request and one session may hold; a request past a bound is refused with HTTP 400 (413 for bodies)."""

    max_body_bytes: int = 4 << 20
    max_messages: int = 512
    max_tools: int = 64
    max_turns: int = 64  # completions per session
    max_choices: int = 8  # n
    max_images: int = 16  # per request, over all its messages
    max_spawned: int = 8  # sessions one sample's session may spawn (sub-agents, restarts)


@dataclass
class Conversation:
    messages: list[dict[str, Any]]  # template form
    tools: list[dict[str, Any]]  # [{"type": "function", "function": {"name", "description", "parameters"}}]
    images: list[Image] = field(default_factory=list)  # the messages' image parts' images, in order

    @classmethod
    def of(cls, messages: list[dict[str, Any]], tools: list[dict[str, Any]], images: list[Image],
           limits: Limits) -> Conversation:
        if len(images) > limits.max_images:
            raise InvalidArgument(f"messages: {len(images)} images, at most {limits.max_images} per request")
        return cls(messages, tools, images)


    @property
    def tool_names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools}

    def canonical(self) -> list[dict[str, Any]]:
        return canonical(self.messages)

    def keys(self) -> list[tuple]:
        return [message_key(m) for m in self.canonical()]

    def tools_key(self) -> str:
        return json.dumps(self.tools, sort_keys=True)


def canonical(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages in the order histories are matched in: the system text first, wherever the agent put it (several
    system messages joined), then the others in order. An agent that moves its system prompt continues its turns."""
    system = [m for m in messages if m["role"] == "system"]
    if not system:
        return list(messages)
    rest = [m for m in messages if m["role"] != "system"]
    if len(system) == 1 and messages[0] is system[0]:
        return list(messages)
    return [{"role": "system", "content": "\n\n".join(m.get("content") or "" for m in system)}, *rest]


def message_key(message: dict[str, Any]) -> tuple:
    """What must be equal for a message sent back to be the one the gateway produced: role, text up to whitespace
    (agents strip, re-indent or re-wrap what they send back; an image part as its bytes' digest) and tool calls by name
    and arguments as parsed JSON (so a re-serialized argument is the same call; ids are the gateway's own, so they are
    not compared)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or [])
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(f" <image {p['digest']}> " if p["type"] == "image" else p["text"] for p in content)
    return message["role"], " ".join(content.split()), calls


def text_of(message: dict[str, Any]) -> str:
    """A message's text: its content, or its text parts joined."""
    content = message.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def count_image_parts(message: dict[str, Any]) -> int:
    content = message.get("content")
    return sum(1 for p in content if p["type"] == "image") if isinstance(content, list) else 0


def _image_part(image: Image) -> dict[str, str]:
    """A template-form image part; its digest tells images apart in message keys (chat templates ignore it)."""
    return {"type": "image", "digest": hashlib.sha256(image.data).hexdigest()[:32]}


def _with_images(parts: list[dict[str, str] | Image], images: list[Image]) -> str | list[dict[str, str]]:
    """Text pieces and images as a message's content: the text joined when there is no image, else a list of text
    and image parts in order (the images appended to `images`)."""
    if not any(isinstance(p, Image) for p in parts):
        return "".join(p["text"] for p in parts)  # type: ignore[index]
    content: list[dict[str, str]] = []
    for part in parts:
        if isinstance(part, Image):
            images.append(part)
            content.append(_image_part(part))
        elif part["text"]:
            content.append({"type": "text", "text": part["text"]})
    return content


def _checked_image(read: Any, where: str) -> Image:
    """The image `read()` returns; InvalidArgument naming `where` and what is wrong with it."""
    try:
        return read()
    except ValueError as err:
        raise InvalidArgument(f"{where}: {err}") from None
    except Exception as err:  # noqa: BLE001 - any other failure of a decoder on bytes from the network
        raise InvalidArgument(f"{where}: corrupt image: {type(err).__name__}: {err}") from None


def assistant_message(content: str, calls: list[tuple[str, dict[str, Any], str]]) -> dict[str, Any]:
    """A produced turn in template form; calls are (name, arguments, id)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
                                 for name, args, call_id in calls]
    return message


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (OpenAI's {"type": "text"}, Anthropic's)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidArgument(f"{where}: content part of type {kind!r} is not supported (text only)")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidArgument(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(raw: Any, param: str) -> dict[str, Any]:
    """A call's arguments sent back, parsed; RequestInvalid naming the field (`param`) when they are not a JSON
    object (the gateway returns only calls whose arguments are: a broken call comes back as text)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError as err:
            raise RequestInvalid(f"the arguments text is not JSON: {err}", param) from None
    if not isinstance(raw, dict):
        raise RequestInvalid("the arguments must be a JSON object", param)
    return raw


def _check_counts(num_messages: int, num_tools: int, limits: Limits) -> None:
    if not num_messages:
        raise InvalidArgument("messages: must not be empty")
    if num_messages > limits.max_messages:
        raise InvalidArgument(f"messages: {num_messages} messages, at most {limits.max_messages} per request")
    if num_tools > limits.max_tools:
        raise InvalidArgument(f"tools: {num_tools} tools, at most {limits.max_tools} per request")


def _function_tool(name: Any, description: Any, parameters: Any, where: str, schema_param: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}: a tool needs a non-empty string name")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidArgument(f"{where}: the parameters schema must be a JSON object")
    if parameters is not None:
        check_json_schema(parameters, schema_param)
    function = {"name": name, "description": description if isinstance(description, str) else "",
                "parameters": parameters or {"type": "object", "properties": {}}}
    return {"type": "function", "function": function}


def _with_image_parts(content: Any, where: str, images: list[Image], image_type: str,
                     read_image: Callable[[dict[str, Any], str], Image], text: Callable[[Any, str], str],
                     field_name: str = "content") -> str | list[dict[str, str]]:
    """A content that may hold images: text (`text` reads it), or its text parts and its parts of `image_type`
    (`read_image(part, where)` decodes and checks one; no URL is fetched), the images appended to `images`."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == image_type for p in content):
        return text(content, where)
    parts: list[dict[str, str] | Image] = []
    for j, part in enumerate(content):
        at = f"{where}.{field_name}[{j}]"
        if isinstance(part, dict) and part.get("type") == image_type:
            parts.append(read_image(part, at))
        else:
            parts.append({"type": "text", "text": text([part], at)})
    return _with_images(parts, images)


def _openai_image(part: dict[str, Any], where: str) -> Image:
    """An `image_url` part's image: its URL must be a data: URL."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise InvalidArgument(f"{where}: image_url must be {{'url': 'data:image/...;base64,...'}}")
    return _checked_image(lambda: data_url_image(url), where)


def _responses_image(part: dict[str, Any], where: str) -> Image:
    """An `input_image` part's image: its image_url must be a data: URL."""
    url = part.get("image_url")
    if not isinstance(url, str):
        raise InvalidArgument(f"{where}: an 'input_image' part needs image_url, a data:image/...;base64, URL (file_id "
                              "is not supported)")
    return _checked_image(lambda: data_url_image(url), f"{where} 'input_image'")


def from_openai(body: dict[str, Any], limits: Limits) -> Conversation:
    """OpenAI Chat Completions `messages` and `tools`."""
    messages, tools = body.get("messages"), body.get("tools") or []
    if not isinstance(messages, list) or not isinstance(tools, list):
        raise InvalidArgument("messages and tools must be lists")
    _check_counts(len(messages), len(tools), limits)
    out = []
    images: list[Image] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidArgument(f"{where}: role must be one of {', '.join(ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        if role == "user":
            content = _with_image_parts(message.get("content"), where, images, "image_url", _openai_image, _text)
        else:  # OpenAI's tool messages hold text parts only
            content = _text(message.get("content"), where)
        item: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise InvalidArgument(f"{where}: tool_calls must be a list")
            item["tool_calls"] = [{"id": str(c.get("id", "")), "type": "function",
                                   "function": {"name": str((c.get("function") or {}).get("name", "")),
                                                "arguments": _arguments((c.get("function") or {}).get("arguments"),
                                                                        f"{where}.tool_calls[{j}].function.arguments")}}
                                  for j, c in enumerate(calls) if isinstance(c, dict)]
        if role == "tool":
            item["tool_call_id"] = str(message.get("tool_call_id", ""))
        out.append(item)
    checked = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise InvalidArgument(f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools are supported")
        checked.append(_function_tool(function.get("name"), function.get("description"), function.get("parameters"),
                                      f"tools[{i}]", f"tools[{i}].function.parameters"))
    return Conversation.of(out, checked, images, limits)


def from_anthropic(body: dict[str, Any], limits: Limits) -> Conversation:
    """Anthropic Messages `system`, `messages` (text, tool_use and tool_result blocks; a `system` message among them,
    as Claude Code sends its environment, is kept in place) and `tools`."""
    messages, tools = body.get("messages"), body.get("tools") or []
    if not isinstance(messages, list) or not isinstance(tools, list):
        raise InvalidArgument("messages and tools must be lists")
    _check_counts(len(messages), len(tools), limits)
    out: list[dict[str, Any]] = []
    images: list[Image] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise InvalidArgument(f"{where}: role must be user, assistant or system")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise InvalidArgument(f"{where}: content must be a string or a list of blocks")
        out.extend(_anthropic_blocks(message["role"], blocks, where, images))
    checked = [_function_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]",
                              f"tools.{i}.input_schema")
               if isinstance(t, dict) else _function_tool(None, None, None, f"tools[{i}]", "")
               for i, t in enumerate(tools)]
    return Conversation.of(out, checked, images, limits)


def _anthropic_image(block: dict[str, Any], where: str) -> Image:
    """An `image` block with a base64 source, checked (its declared media type must be the bytes' own)."""
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64" or not isinstance(source.get("data"), str):
        kind = source.get("type") if isinstance(source, dict) else None
        raise InvalidArgument(f"{where}: block type 'image' with source type {kind!r} is not supported (base64 "
                              "sources only: the gateway fetches nothing from the network)")
    image = _checked_image(lambda: check_image(decode_base64(source["data"])), where)
    if source.get("media_type") not in (None, image.mime_type):
        raise InvalidArgument(f"{where}: media_type {source.get('media_type')!r}, but the data is {image.mime_type}")
    return image


def _anthropic_blocks(role: str, blocks: list[Any], where: str, images: list[Image]) -> list[dict[str, Any]]:
    """One Anthropic message as template messages: tool results become `tool` messages (before any text of the same
    user turn), an assistant's text and tool_use blocks one assistant message; a user's image blocks image parts."""
    texts: list[dict[str, str] | Image] = []
    calls, results = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append({"type": "text", "text": _text([block], f"{where}.content[{j}]")})
        elif role == "system":
            raise InvalidArgument(f"{where}.content[{j}]: a system message holds text blocks only")
        elif kind == "image" and role == "user":
            texts.append(_anthropic_image(block, f"{where}.content[{j}]"))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": str(block.get("name", "")),
                                       "arguments": _arguments(block.get("input", {}), f"{where}.content[{j}].input")}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _with_image_parts(block.get("content"), f"{where}.content[{j}]", images,
                                                         "image", _anthropic_image, _text)})
        else:
            allowed = "text, tool_use" if role == "assistant" else "text, image, tool_result"
            raise InvalidArgument(f"{where}.content[{j}]: block type {kind!r} is not supported in a {role} message "
                                  f"({allowed})")
    if role == "system":
        return [{"role": "system", "content": _with_images(texts, images)}]
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": _with_images(texts, images)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    return results + ([{"role": "user", "content": _with_images(texts, images)}] if texts or not results else [])


def _response_text(content: Any, where: str) -> str:
    """Responses content: a string, or a list of input_text / output_text parts."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidArgument(f"{where}.content[{j}]: part of type {kind!r} is not supported (input_text, "
                                      "output_text)")
        content = [{"type": "text", "text": part.get("text")} for part in content]
    return _text(content, where)


def from_responses(body: dict[str, Any], limits: Limits, history: list[dict[str, Any]],
                   history_images: list[Image] | None = None) -> Conversation:
    """OpenAI Responses `instructions`, `input` (messages, function_call and function_call_output items) and `tools`,
    after `history` (the template messages of the previous response, its input and output, and `history_images`, the
    images of its image parts). An assistant message and the function calls after it are one assistant turn, as the
    gateway produced them; a user message's `input_image` parts are images, as in Chat Completions."""
    items, tools = body.get("input"), body.get("tools") or []
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not isinstance(tools, list):
        raise InvalidArgument("input and tools must be lists")
    out: list[dict[str, Any]] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    out += [dict(message) for message in history]
    images = list(history_images or [])
    first_new = len(out)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        open_turn = out[-1] if len(out) > first_new and out[-1]["role"] == "assistant" else None
        if kind == "message" and item.get("role") in ROLES:
            role = "system" if item["role"] == "developer" else item["role"]
            if role == "user":
                out.append({"role": role, "content": _with_image_parts(item.get("content"), where, images,
                                                                       "input_image", _responses_image,
                                                                       _response_text)})
                continue
            text = _response_text(item.get("content"), where)
            if role == "assistant" and open_turn is not None and not open_turn.get("tool_calls"):
                open_turn["content"] += text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")),
                                 "arguments": _arguments(item.get("arguments", ""), f"{where}.arguments")}}
            if open_turn is None:
                open_turn = {"role": "assistant", "content": ""}
                out.append(open_turn)
            open_turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _with_image_parts(item.get("output"), where, images, "input_image",
                                                     _responses_image, _response_text, "output")})
        else:
            raise RequestInvalid(f"item type {kind!r} is not supported (message, function_call, "
                                 "function_call_output)", f"{where}.type")
    if not items:
        raise InvalidArgument("input: must not be empty")
    _check_counts(len(out), len(tools), limits)
    checked = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestInvalid("only function tools ({'type': 'function', 'name': ...}) are supported",
                                 f"tools[{i}].type")
        checked.append(_function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"),
                                      f"tools[{i}]", f"tools[{i}].parameters"))
    return Conversation.of(out, checked, images, limits)
