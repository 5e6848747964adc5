"""Plain JSON only: no NaN or infinity, no lone surrogate, no nesting past MAX_DEPTH, nothing but JSON's own types.

Python's json module (and YAML) accept all of these, and each became a 500 or INTERNAL downstream, where an error
that echoed the value could not be encoded. `check_value` names what is wrong and where; `parse_body` and the
`StrictJsonBodies` middleware refuse such a REST body with a 400 before any handler sees it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from services.common.errors import InvalidArgument

MAX_DEPTH = 64  # deeper than any job spec, score request or dataset row needs
_BODY_METHODS = {"POST", "PUT", "PATCH"}


def check_value(value: Any, where: str = "body", depth: int = 0) -> str:
    """'' when `value` is plain JSON, else what is wrong with it and where ("body.samples[0].prompt: ..."; with
    `where` empty, a mapping's keys start the path: "num_rollout: ...")."""
    if depth > MAX_DEPTH:
        return f"{where}: nested more than {MAX_DEPTH} levels"
    if value is None or isinstance(value, (bool, int)):
        return ""
    if isinstance(value, float):
        return "" if math.isfinite(value) else f"{where}: {value!r} is not a finite number"
    if isinstance(value, str):
        return _check_text(value, where)
    if isinstance(value, list):
        return next((p for i, item in enumerate(value) if (p := check_value(item, f"{where}[{i}]", depth + 1))), "")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where}: key {key!r} is a {type(key).__name__}, not a string"
            inner = f"{where}.{key}" if where else key
            if problem := _check_text(key, f"{where} key") or check_value(item, inner, depth + 1):
                return problem
        return ""
    shown = repr(value)[:60]
    return f"{where}: {shown} is a {type(value).__name__}, not a JSON value (quote it to send a string)"


def _check_text(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"{where}: lone surrogate U+{ord(text[err.start]):04X} at character {err.start} (not valid Unicode; "
                "send the character itself or a surrogate pair)")
    return ""


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number (send a finite number)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of a float's range")
    return value


def parse_body(body: bytes, what: str = "request body") -> Any:
    """The JSON in `body`, or InvalidArgument naming the first thing that is not plain JSON."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except UnicodeDecodeError as err:
        raise InvalidArgument(f"{what}: not UTF-8 (byte {err.start}: {err.reason})") from None
    except ValueError as err:  # JSONDecodeError, a refused constant or float, an int of too many digits
        raise InvalidArgument(f"{what}: invalid JSON: {err}") from None
    except RecursionError:
        raise InvalidArgument(f"{what}: nested more than {MAX_DEPTH} levels") from None
    if problem := check_value(value, what):
        raise InvalidArgument(problem)
    return value


class StrictJsonBodies:
    """ASGI middleware: a JSON request body that `parse_body` refuses gets a 400 naming why; the others reach the
    app unchanged (it parses them again, now safely)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if body.strip():
            try:
                parse_body(body)
            except InvalidArgument as err:
                from fastapi.responses import JSONResponse  # only REST services import fastapi

                await JSONResponse({"detail": str(err)}, status_code=400)(scope, receive, send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _is_json(scope) -> bool:
    """FastAPI reads a body without a content type as JSON too."""
    types = [value for name, value in scope.get("headers", ()) if name == b"content-type"]
    return not types or b"json" in types[0].lower()
