"""The gateway's input contract: a request body parsed and checked against the schema of the API it claims (OpenAI
Chat Completions and Responses, Anthropic Messages) before any work: JSON only (no NaN or Infinity), bounded nesting,
valid Unicode (no lone surrogates), every modelled field of the right type and range, unknown top-level fields
refused as the hosted APIs refuse them. Each failure is a RequestInvalid naming the field (OpenAI's `param`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidArgument

MAX_DEPTH = 64  # JSON nesting of a whole body; tool schemas and arguments are far shallower


class RequestInvalid(InvalidArgument):
    """A body that breaks the API's contract; `param` is the path of the field at fault ("messages[2].content")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


@dataclass(frozen=True)
class Scalar:
    kinds: tuple[str, ...]  # string, integer, number, boolean, null
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Obj:
    fields: dict[str, Any]
    required: tuple[str, ...] = ()
    closed: bool = False  # unknown fields refused (the top level); else ignored


@dataclass(frozen=True)
class Arr:
    item: Any
    max_items: int | None = None


@dataclass(frozen=True)
class OneOf:
    options: tuple[Any, ...]
    names: str = field(default="")  # what the field must be, for the message


ANY = Scalar(("any",))  # any JSON value (its depth and strings are checked by the walk over the whole body)
STR, INT, BOOL = Scalar(("string",)), Scalar(("integer",)), Scalar(("boolean",))


def num(minimum: float | None = None, maximum: float | None = None, *, null: bool = True, kind: str = "number"):
    return Scalar((kind, "null") if null else (kind,), minimum, maximum)


def opt(spec: Any) -> Any:
    """`spec` or null."""
    if isinstance(spec, Scalar):
        return Scalar((*spec.kinds, "null"), spec.minimum, spec.maximum, spec.choices)
    return OneOf((spec, Scalar(("null",))))


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _fits(value: Any, kind: str) -> bool:
    if kind == "any":
        return True
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # number


def _describe(spec: Any) -> str:
    if isinstance(spec, Scalar):
        return " or ".join(spec.kinds)
    if isinstance(spec, Obj):
        return "an object"
    if isinstance(spec, Arr):
        return "a list"
    return spec.names or " or ".join(_describe(o) for o in spec.options)


def check(value: Any, spec: Any, path: str) -> None:
    """Raise RequestInvalid unless `value` fits `spec`."""
    if isinstance(spec, Scalar):
        if not any(_fits(value, kind) for kind in spec.kinds):
            raise RequestInvalid(f"expected {_describe(spec)}, got {_type_name(value)}", path)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if spec.minimum is not None and value < spec.minimum or spec.maximum is not None and value > spec.maximum:
                raise RequestInvalid(f"{value!r} is out of range [{spec.minimum}, {spec.maximum}]", path)
        if spec.choices and isinstance(value, str) and value not in spec.choices:
            raise RequestInvalid(f"{value!r} is not one of {', '.join(spec.choices)}", path)
    elif isinstance(spec, Obj):
        if not isinstance(value, dict):
            raise RequestInvalid(f"expected an object, got {_type_name(value)}", path)
        for name in spec.required:
            if name not in value:
                raise RequestInvalid("Field required", _join(path, name))
        if spec.closed and (unknown := sorted(set(value) - set(spec.fields))):
            raise RequestInvalid(f"unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
        for name, sub in spec.fields.items():
            if name in value:
                check(value[name], sub, _join(path, name))
    elif isinstance(spec, Arr):
        if not isinstance(value, list):
            raise RequestInvalid(f"expected a list, got {_type_name(value)}", path)
        if spec.max_items is not None and len(value) > spec.max_items:
            raise RequestInvalid(f"{len(value)} items, at most {spec.max_items}", path)
        for i, item in enumerate(value):
            check(item, spec.item, f"{path}[{i}]")
    else:
        errors = []
        for option in spec.options:
            try:
                check(value, option, path)
                return
            except RequestInvalid as err:
                errors.append(err)
        # the option of the value's own kind explains best (an object with a bad field, not "expected a string")
        same = [e for e, o in zip(errors, spec.options, strict=True) if _same_kind(value, o)]
        raise (same or [RequestInvalid(f"expected {_describe(spec)}, got {_type_name(value)}", path)])[0]


def _same_kind(value: Any, spec: Any) -> bool:
    return isinstance(spec, Obj) and isinstance(value, dict) or isinstance(spec, Arr) and isinstance(value, list)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def walk(body: Any, max_depth: int = MAX_DEPTH) -> None:
    """Every value of `body`, iteratively: nesting at most `max_depth`, every string (and key) valid UTF-8."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise RequestInvalid(f"JSON nested deeper than {max_depth} levels", path or None)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _utf8(key, path)
                stack.append((item, depth + 1, _join(path, key) if isinstance(key, str) else f"{path}[{key}]"))
        elif isinstance(value, str):
            _utf8(value, path)


def _utf8(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestInvalid(f"invalid Unicode: a lone surrogate at character {err.start}", path or None) from None


JSON_SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def check_json_schema(schema: Any, param: str) -> None:
    """RequestInvalid naming the place unless `schema` reads as a JSON Schema where a tool's parameters are declared:
    an object (or boolean) whose type is a JSON Schema type, whose properties and other subschemas are schemas,
    whose required is a list of names and enum a list; other keywords are left to the model to read."""
    stack = [(schema, param)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise RequestInvalid(f"not a JSON Schema: expected an object, got {_type_name(node)}", path)
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if "type" in node else []
        if not all(isinstance(k, str) and k in JSON_SCHEMA_TYPES for k in kinds):
            raise RequestInvalid(f"not a JSON Schema: type must be one of {', '.join(JSON_SCHEMA_TYPES)} (or a "
                                 f"list of them), got {kind!r}", _join(path, "type"))
        if "required" in node and not (isinstance(node["required"], list)
                                       and all(isinstance(r, str) for r in node["required"])):
            raise RequestInvalid("not a JSON Schema: required must be a list of property names",
                                 _join(path, "required"))
        if "enum" in node and not isinstance(node["enum"], list):
            raise RequestInvalid("not a JSON Schema: enum must be a list", _join(path, "enum"))
        for name in _SUBSCHEMA_MAPS:
            if name in node:
                if not isinstance(node[name], dict):
                    raise RequestInvalid(f"not a JSON Schema: {name} must be an object of schemas", _join(path, name))
                stack += [(sub, f"{_join(path, name)}.{key}") for key, sub in node[name].items()]
        for name in _SUBSCHEMA_LISTS:
            if name in node:
                if not isinstance(node[name], list):
                    raise RequestInvalid(f"not a JSON Schema: {name} must be a list of schemas", _join(path, name))
                stack += [(sub, f"{_join(path, name)}[{i}]") for i, sub in enumerate(node[name])]
        stack += [(node[name], _join(path, name)) for name in _SUBSCHEMAS if name in node]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse(data: bytes, schema: Obj) -> dict[str, Any]:
    """The body as a dict that fits `schema`; RequestInvalid otherwise (never RecursionError or UnicodeError)."""
    try:
        body = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise RequestInvalid(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestInvalid(f"the body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise RequestInvalid(f"the body must be a JSON object, got {_type_name(body)}")
    walk(body)
    check(body, schema, "")
    return body


# --- OpenAI Chat Completions -------------------------------------------------------------------------------------

_TEXT_PART = Obj({"type": STR, "text": STR}, required=("type",))
_OPENAI_CONTENT = OneOf((Scalar(("string", "null")), Arr(_TEXT_PART)), "a string, null or a list of content parts")
_OPENAI_TOOL_CALL = Obj({"id": STR, "type": STR, "function": Obj(
    {"name": STR, "arguments": OneOf((STR, Obj({})), "a JSON string or an object")}, required=("name",))},
    required=("function",))
_OPENAI_MESSAGE = Obj({"role": Scalar(("string",), choices=("system", "developer", "user", "assistant", "tool")),
                       "content": _OPENAI_CONTENT, "name": STR, "tool_calls": opt(Arr(_OPENAI_TOOL_CALL)),
                       "tool_call_id": STR, "refusal": opt(STR)}, required=("role",))
_OPENAI_TOOL = Obj({"type": STR, "function": Obj({"name": STR, "description": opt(STR), "parameters": opt(Obj({})),
                                                  "strict": opt(BOOL)}, required=("name",))},
                   required=("function",))

OPENAI_CHAT = Obj({
    "model": STR, "messages": Arr(_OPENAI_MESSAGE), "tools": opt(Arr(_OPENAI_TOOL)),
    "tool_choice": opt(OneOf((STR, Obj({"type": STR, "function": Obj({"name": STR})})), "a string or an object")),
    "temperature": num(0, 2), "top_p": num(0, 1), "frequency_penalty": num(-2, 2), "presence_penalty": num(-2, 2),
    "max_tokens": num(1, kind="integer"), "max_completion_tokens": num(1, kind="integer"),
    "n": num(1, 128, kind="integer"), "seed": num(kind="integer"), "top_logprobs": num(0, 20, kind="integer"),
    "stop": opt(OneOf((STR, Arr(STR)), "a string or a list of strings")), "logprobs": opt(BOOL), "stream": opt(BOOL),
    "stream_options": opt(Obj({"include_usage": opt(BOOL)})), "parallel_tool_calls": opt(BOOL), "user": STR,
    "metadata": opt(Obj({})), "store": opt(BOOL), "response_format": opt(Obj({"type": STR}, required=("type",))),
}, required=("messages",), closed=True)

# --- Anthropic Messages ------------------------------------------------------------------------------------------

_CACHE = opt(Obj({"type": STR}))
_TEXT_BLOCK = Obj({"type": STR, "text": STR, "cache_control": _CACHE}, required=("type",))
_BLOCK = Obj({"type": STR, "text": STR, "id": STR, "name": STR, "input": Obj({}), "tool_use_id": STR,
              "content": OneOf((STR, Arr(_TEXT_BLOCK)), "a string or a list of text blocks"), "is_error": BOOL,
              "cache_control": _CACHE}, required=("type",))
_ANTHROPIC_MESSAGE = Obj({"role": Scalar(("string",), choices=("user", "assistant", "system")),
                          "content": OneOf((STR, Arr(_BLOCK)), "a string or a list of content blocks")},
                         required=("role", "content"))
_ANTHROPIC_TOOL = Obj({"name": STR, "description": STR, "input_schema": Obj({}), "type": STR,
                       "cache_control": _CACHE}, required=("name",))

ANTHROPIC_MESSAGES = Obj({
    "model": STR, "messages": Arr(_ANTHROPIC_MESSAGE), "max_tokens": num(1, kind="integer", null=False),
    "system": OneOf((STR, Arr(_TEXT_BLOCK)), "a string or a list of text blocks"), "tools": Arr(_ANTHROPIC_TOOL),
    "tool_choice": Obj({"type": STR, "name": STR, "disable_parallel_tool_use": BOOL}, required=("type",)),
    "temperature": num(0, 1, null=False), "top_p": num(0, 1, null=False), "top_k": num(0, kind="integer", null=False),
    "stop_sequences": Arr(STR), "stream": BOOL, "metadata": Obj({"user_id": opt(STR)}),
    "thinking": Obj({"type": STR, "budget_tokens": INT}, required=("type",)), "service_tier": STR,
    "cache_control": _CACHE, "speed": ANY, "inference_geo": ANY, "diagnostics": ANY, "user_profile_id": ANY,
    "workspace_id": ANY, "output_config": opt(Obj({"effort": STR})),  # Claude Code's effort hint (anthropic_api.py)
}, required=("model", "messages", "max_tokens"), closed=True)

# --- OpenAI Responses --------------------------------------------------------------------------------------------

_RESPONSES_PART = Obj({"type": STR, "text": STR, "annotations": ANY, "logprobs": ANY}, required=("type",))
_RESPONSES_TEXT = OneOf((STR, Arr(_RESPONSES_PART)), "a string or a list of content parts")
# one object for every input item kind (message, function_call, function_call_output): responses_api.py reads the
# `type` and refuses the fields a kind lacks
_RESPONSES_ITEM = Obj({"type": STR, "id": STR, "status": STR,
                       "role": Scalar(("string",), choices=("system", "developer", "user", "assistant")),
                       "content": _RESPONSES_TEXT, "call_id": STR, "name": STR, "arguments": STR,
                       "output": _RESPONSES_TEXT})
_RESPONSES_TOOL = Obj({"type": STR, "name": STR, "description": opt(STR), "parameters": opt(Obj({})),
                       "strict": opt(BOOL)}, required=("type",))

OPENAI_RESPONSES = Obj({
    "model": STR, "input": OneOf((STR, Arr(_RESPONSES_ITEM)), "a string or a list of input items"),
    "instructions": opt(STR), "tools": opt(Arr(_RESPONSES_TOOL)),
    "tool_choice": opt(OneOf((STR, Obj({"type": STR, "name": STR}, required=("type",))), "a string or an object")),
    "temperature": num(0, 2), "top_p": num(0, 1), "max_output_tokens": num(1, kind="integer"),
    "max_tool_calls": num(1, kind="integer"), "top_logprobs": num(0, 20, kind="integer"), "stream": opt(BOOL),
    "stream_options": opt(Obj({"include_obfuscation": opt(BOOL)})), "previous_response_id": opt(STR),
    "store": opt(BOOL), "metadata": opt(Obj({})), "parallel_tool_calls": opt(BOOL), "user": STR,
    "text": opt(Obj({"format": Obj({"type": STR}, required=("type",)), "verbosity": opt(STR)})),
    "reasoning": opt(Obj({"effort": opt(STR), "summary": opt(STR), "generate_summary": opt(STR)})),
    "truncation": opt(Scalar(("string",), choices=("auto", "disabled"))), "include": opt(Arr(STR)),
    "service_tier": opt(STR), "prompt_cache_key": STR, "safety_identifier": STR, "background": opt(BOOL),
    "client_metadata": opt(Obj({})),  # Codex's per-turn ids, as `metadata`: kept by nobody here
}, required=("input",), closed=True)
