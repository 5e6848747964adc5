"""Tool calls in model output: the Qwen/Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(what slime's and SGLang's qwen25/hermes parsers read). Knows nothing of either API's wire shape.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(the text outside the tool calls, stripped; the calls). A block that is not a JSON object with a string
    "name" of a declared tool and object "arguments" stays in the text, as SGLang's parser leaves it."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _one_call(match.group(1), tool_names)
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _one_call(body: str, tool_names: set[str]) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or data["name"] not in tool_names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=data["name"], arguments=arguments)
