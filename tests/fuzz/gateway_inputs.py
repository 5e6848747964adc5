"""The agent gateway's hostile inputs for `make fuzz`: valid OpenAI Chat Completions, OpenAI Responses and Anthropic
Messages bodies (plain and streamed) with one part mutated at random: a field of the wrong type, a deep nest, a lone
surrogate, a huge or unknown field, broken JSON, a message past the model's context, wrong headers. Each is
("gateway", what, send), `send()` returning a probes outcome: any answer below 500 in time is clear.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from tests.fuzz import probes

ROUTES = {"openai": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}
MAX_BODY_BYTES = 4 << 20  # the gateway's default bound


def base_body(api: str, stream: bool, rng: random.Random) -> dict[str, Any]:
    """A valid body of `api` with a little of everything it models."""
    if api == "openai":
        return {"model": "m", "stream": stream, "max_tokens": 2, "temperature": 0.0, "stop": ["\n\n"],
                "tools": [{"type": "function", "function": {"name": "calculator", "description": "Arithmetic.",
                                                            "parameters": {"type": "object", "properties": {}}}}],
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}="},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": "c1", "type": "function",
                                  "function": {"name": "calculator", "arguments": "{\"expression\": \"1+1\"}"}}]},
                             {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "2"}]}],
                **({"stream_options": {"include_usage": True}} if stream else {})}
    if api == "responses":
        return {"model": "m", "stream": stream, "max_output_tokens": 2, "temperature": 0.0, "instructions": "Be brief.",
                "store": True, "tool_choice": "auto", "text": {"format": {"type": "text"}},
                "tools": [{"type": "function", "name": "calculator", "description": "Arithmetic.",
                           "parameters": {"type": "object", "properties": {}}, "strict": False}],
                "input": [{"role": "user", "content": [{"type": "input_text",
                                                        "text": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}="}]},
                          {"type": "function_call", "call_id": "c1", "name": "calculator",
                           "arguments": "{\"expression\": \"1+1\"}"},
                          {"type": "function_call_output", "call_id": "c1", "output": "2"},
                          {"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": "2", "annotations": []}]},
                          {"role": "user", "content": "so?"}]}
    return {"model": "m", "stream": stream, "max_tokens": 2, "temperature": 0.0, "stop_sequences": ["\n\n"],
            "system": [{"type": "text", "text": "Be brief."}], "metadata": {"user_id": "u"},
            "tools": [{"name": "calculator", "description": "Arithmetic.", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}="},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "calculator",
                                                            "input": {"expression": "1+1"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"},
                                                      {"type": "text", "text": "so?"}]}]}


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path into `value` (keys and list indices), the root's children first."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*path, key)
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield (*path, i)
            yield from _paths(item, (*path, i))


def _set(body: Any, path: tuple, value: Any) -> None:
    for step in path[:-1]:
        body = body[step]
    body[path[-1]] = value


DEEP = "\u2063deep\u2063"  # stands for a nest too deep for json.dumps; replaced in the encoded body


def _deep(depth: int) -> bytes:
    return b'{"k": [' * (depth // 2) + b'"x"' + b"]}" * (depth // 2)


def _encoded(body: Any, rng: random.Random) -> bytes:
    data = json.dumps(body).encode()
    marker = json.dumps(DEEP).encode()
    return data.replace(marker, _deep(rng.randint(65, 20_000))) if marker in data else data


HOSTILE_VALUES: list[tuple[str, Callable[[random.Random], Any]]] = [
    ("string", lambda r: "oops"), ("integer", lambda r: r.choice([0, -1, 2**63, -(2**70)])),
    ("float", lambda r: r.choice([1e308, -0.5, 3.7])), ("bool", lambda r: r.random() < 0.5), ("null", lambda r: None),
    ("list", lambda r: [1, "a", None]), ("object", lambda r: {"type": "function", "function": "calculator"}),
    ("empty list", lambda r: []), ("empty object", lambda r: {}), ("deep nest", lambda r: DEEP),
    ("lone surrogate", lambda r: "a\ud800b"), ("long string", lambda r: "7" * r.randint(10_000, 300_000)),
    ("control chars", lambda r: "\x00\x1b[2J\u202e"), ("many items", lambda r: ["s"] * r.randint(600, 5000)),
]


def _mutated(api: str, stream: bool, rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    """(what, raw body, extra headers) of one hostile request."""
    body = base_body(api, stream, rng)
    kind = rng.choices(["value", "unknown", "raw", "huge", "drop", "headers"], weights=[70, 6, 8, 4, 8, 4])[0]
    headers: dict[str, str] = {}
    if kind == "value":
        path = rng.choice(list(_paths(body)))
        name, make = rng.choice(HOSTILE_VALUES)
        _set(body, path, make(rng))
        what = f"{'.'.join(map(str, path))} = {name}"
    elif kind == "unknown":
        path = rng.choice([p for p in _paths(body) if isinstance(_get(body, p), dict)] + [()])
        target = _get(body, path)
        target[rng.choice(["frobnicate", "__proto__", "n_ctx", "ÿ", "logit_bias"])] = rng.choice([1, "x", {}])
        what = f"unknown field under {'.'.join(map(str, path)) or 'the body'}"
    elif kind == "drop":
        path = rng.choice(list(_paths(body)))
        parent = _get(body, path[:-1])
        del parent[path[-1]]
        what = f"without {'.'.join(map(str, path))}"
    elif kind == "huge":  # a message as large as the body bound allows, far past the tiny model's context
        text = "12+34=46 " * ((MAX_BODY_BYTES - 4096) // 9)
        if api == "responses":
            body["input"][0]["content"] = text
        else:
            body["messages"][0 if api == "anthropic" else 1]["content"] = text
        what = f"a {len(text) >> 20} MiB message"
    elif kind == "headers":
        headers = rng.choice([{"content-type": "text/plain"}, {"authorization": "Bearer sk-wrong", "x-api-key": ""},
                              {"content-encoding": "gzip"}, {"anthropic-version": "1999-01-01"}])
        what = f"headers {headers}"
    else:
        data = json.dumps(body).encode()
        raw = rng.choice([data[:rng.randint(0, len(data))], data.replace(b"0.0", b"NaN"), b"\xff\xfe" + data,
                          b"[" * 100_000, data + b"}", b'"just a string"', bytes(rng.randrange(256) for _ in range(64)),
                          data.replace(b'"m"', b'"\\udc00"')])
        return f"{api} raw bytes {raw[:30]!r}", raw, headers
    return f"{api}{' stream' if stream else ''} {what}", _encoded(body, rng), headers


def _get(body: Any, path: tuple) -> Any:
    for step in path:
        body = body[step]
    return body


def gateway_requests(url: str, keys: list[str], http: httpx.Client, rng: random.Random,
                     count: int) -> Iterator[tuple[str, str, Callable[[], str]]]:
    """`count` hostile requests, a third each Chat Completions, Responses and Messages, half streamed, over the
    sessions of `keys`."""
    for i in range(count):
        api, stream = ("openai", "anthropic", "responses")[i % 3], bool(i // 3 % 2)
        what, raw, headers = _mutated(api, stream, rng)
        key = keys[i % len(keys)]
        headers = {"authorization": f"Bearer {key}", "x-api-key": key, "content-type": "application/json",
                   "anthropic-version": "2023-06-01", **headers}
        yield ("gateway", what, lambda r=api, b=raw, h=headers: send(http, f"{url}{ROUTES[r]}", b, h))


def send(http: httpx.Client, url: str, raw: bytes, headers: dict[str, str]) -> str:
    """The request, streamed replies read to their end: any answer below 500 in time is clear; a 5xx, a broken
    connection or an error event of the server's side (sent once a stream's headers are out) is internal."""
    try:
        with http.stream("POST", url, content=raw, headers=headers, timeout=probes.DEADLINE_S) as reply:
            text = b"".join(reply.iter_bytes()).decode(errors="replace")
    except httpx.TimeoutException:
        return probes.HANG
    except httpx.TransportError:
        return probes.INTERNAL
    if reply.status_code >= 500 or any(f'"{kind}"' in text for kind in ("api_error", "server_error",
                                                                         "overloaded_error")):
        return probes.INTERNAL
    return probes.CLEAR
