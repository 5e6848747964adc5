"""Both APIs' requests as one conversation: messages in the form chat templates read (OpenAI's, with tool-call
arguments as objects) plus the tools, checked and bounded; and each message's canonical key, which is how a
history sent back is matched to the turns the gateway produced. Knows nothing of tokens or HTTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgument

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Limits:
    """What one request and one session may hold; a request past a bound is refused with HTTP 400 (413 for bodies)."""

    max_body_bytes: int = 4 << 20
    max_messages: int = 512
    max_tools: int = 64
    max_turns: int = 64  # completions per session
    max_choices: int = 8  # n


@dataclass
class Conversation:
    messages: list[dict[str, Any]]  # template form
    tools: list[dict[str, Any]]  # [{"type": "function", "function": {"name", "description", "parameters"}}]

    @property
    def tool_names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools}

    def keys(self) -> list[tuple]:
        return [message_key(m) for m in self.messages]

    def tools_key(self) -> str:
        return json.dumps(self.tools, sort_keys=True)


def message_key(message: dict[str, Any]) -> tuple:
    """What must be equal for a message sent back to be the one the gateway produced: role, text (outer whitespace
    aside) and tool calls by name and arguments (ids are the gateway's own, so they are not compared)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return message["role"], (message.get("content") or "").strip(), calls


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


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError as err:
            raise InvalidArgument(f"{where}: function.arguments is not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{where}: function.arguments must be a JSON object")
    return raw


def _check_counts(num_messages: int, num_tools: int, limits: Limits) -> None:
    if not num_messages:
        raise InvalidArgument("messages: must not be empty")
    if num_messages > limits.max_messages:
        raise InvalidArgument(f"messages: {num_messages} messages, at most {limits.max_messages} per request")
    if num_tools > limits.max_tools:
        raise InvalidArgument(f"tools: {num_tools} tools, at most {limits.max_tools} per request")


def _function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}: a tool needs a non-empty string name")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidArgument(f"{where}: the parameters schema must be a JSON object")
    function = {"name": name, "description": description if isinstance(description, str) else "",
                "parameters": parameters or {"type": "object", "properties": {}}}
    return {"type": "function", "function": function}


def from_openai(body: dict[str, Any], limits: Limits) -> Conversation:
    """OpenAI Chat Completions `messages` and `tools`."""
    messages, tools = body.get("messages"), body.get("tools") or []
    if not isinstance(messages, list) or not isinstance(tools, list):
        raise InvalidArgument("messages and tools must be lists")
    _check_counts(len(messages), len(tools), limits)
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidArgument(f"{where}: role must be one of {', '.join(ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        item: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise InvalidArgument(f"{where}: tool_calls must be a list")
            item["tool_calls"] = [{"id": str(c.get("id", "")), "type": "function",
                                   "function": {"name": str((c.get("function") or {}).get("name", "")),
                                                "arguments": _arguments((c.get("function") or {}).get("arguments"),
                                                                        f"{where}.tool_calls[{j}]")}}
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
                                      f"tools[{i}]"))
    return Conversation(out, checked)


def from_anthropic(body: dict[str, Any], limits: Limits) -> Conversation:
    """Anthropic Messages `system`, `messages` (text, tool_use and tool_result blocks) and `tools`."""
    messages, tools = body.get("messages"), body.get("tools") or []
    if not isinstance(messages, list) or not isinstance(tools, list):
        raise InvalidArgument("messages and tools must be lists")
    _check_counts(len(messages), len(tools), limits)
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidArgument(f"{where}: role must be user or assistant")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise InvalidArgument(f"{where}: content must be a string or a list of blocks")
        out.extend(_anthropic_blocks(message["role"], blocks, where))
    checked = [_function_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]")
               if isinstance(t, dict) else _function_tool(None, None, None, f"tools[{i}]")
               for i, t in enumerate(tools)]
    return Conversation(out, checked)


def _anthropic_blocks(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as template messages: tool results become `tool` messages (before any text of the same
    user turn), an assistant's text and tool_use blocks one assistant message."""
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text([block], f"{where}.content[{j}]"))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": str(block.get("name", "")),
                                       "arguments": _arguments(block.get("input", {}), f"{where}.content[{j}]")}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text(block.get("content"), f"{where}.content[{j}]")})
        else:
            raise InvalidArgument(f"{where}.content[{j}]: block type {kind!r} is not supported in a {role} message "
                                  "(text, tool_use, tool_result)")
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
