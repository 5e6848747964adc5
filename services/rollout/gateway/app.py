"""The gateway's HTTP API (FastAPI): /v1/chat/completions, /v1/models, /v1/messages, and the session's own
/v1/session (its state) and /v1/session/reward. Each request's key (Authorization: Bearer, or x-api-key) opens its
own session and no other; bodies are bounded before they are parsed; errors come in each API's error shape.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, PhysarumError, Unavailable
from services.rollout.gateway import anthropic_api, openai_api
from services.rollout.gateway.conversation import from_anthropic, from_openai
from services.rollout.gateway.sessions import Session, SessionRegistry

log = logging.getLogger(__name__)


class BodyTooLarge(InvalidArgument):
    pass


class Unauthorized(Exception):
    pass


def _key(request: Request) -> str:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-api-key", "").strip()


async def _read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise BodyTooLarge(f"request body of {length} bytes, at most {max_bytes}")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > max_bytes:
            raise BodyTooLarge(f"request body over {max_bytes} bytes")
    try:
        body = json.loads(data)
    except ValueError as err:
        raise InvalidArgument(f"request body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    return body


def _error(request: Request, status: int, kind: str, message: str) -> JSONResponse:
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(status_code=status, content={"type": "error", "error": {"type": kind, "message": message}})
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": None,
                                                               "code": None}})


def create_app(registry: SessionRegistry) -> FastAPI:
    app = FastAPI(title="Physarum agent gateway", description="OpenAI and Anthropic APIs over one session per sample")
    limits = registry.limits

    # Handlers for these classes (not for Exception, whose handler Starlette runs and then re-raises, dropping the
    # kept-alive connection under the client's next request); anything else is FastAPI's plain 500.
    async def errors(request: Request, err: Exception) -> JSONResponse:
        if isinstance(err, BodyTooLarge):
            return _error(request, 413, "request_too_large", str(err))
        if isinstance(err, InvalidArgument):
            return _error(request, 400, "invalid_request_error", str(err))
        if isinstance(err, (Unauthorized, NotFound)):
            return _error(request, 401, "authentication_error", f"invalid API key: {err}")
        if isinstance(err, FailedPrecondition):
            return _error(request, 409, "invalid_request_error", str(err))
        if isinstance(err, Unavailable):
            return _error(request, 503, "overloaded_error", str(err))
        log.error("gateway %s failed", request.url.path, exc_info=err)
        return _error(request, 500, "api_error", f"{type(err).__name__}: {err}")

    for kind in (PhysarumError, Unauthorized):
        app.add_exception_handler(kind, errors)

    def session_of(request: Request) -> Session:
        key = _key(request)
        if not key:
            raise Unauthorized("send the session's key as Authorization: Bearer <key> or x-api-key")
        return registry.by_key(key)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(registry.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        session = session_of(request)
        return {"object": "list", "data": [{"id": session.model, "object": "model", "created": 0,
                                            "owned_by": "physarum"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        session = session_of(request)
        body = await _read_json(request, limits.max_body_bytes)
        turn_params = openai_api.params(body)
        conversation = from_openai(body, limits)
        if body.get("tool_choice") == "none":
            conversation.tools = []
        decode = lambda ids: session.renderer.decode(ids, skip_special_tokens=False)  # noqa: E731
        want_logprobs = bool(body.get("logprobs"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if body.get("stream") and turn_params.n == 1:
            turn = session.turn_stream(conversation, turn_params)
            await anext(turn)  # the bounds are checked: a request past one gets its 4xx, not a stream
            return StreamingResponse(openai_api.live_chunks(turn, session.model, want_logprobs, include_usage, decode),
                                     media_type="text/event-stream")
        result = await session.turn(conversation, turn_params)
        if body.get("stream"):
            return StreamingResponse(openai_api.chunks(result, session.model, want_logprobs, include_usage, decode),
                                     media_type="text/event-stream")
        return JSONResponse(openai_api.completion(result, session.model, want_logprobs, decode))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        session = session_of(request)
        body = await _read_json(request, limits.max_body_bytes)
        turn_params = anthropic_api.params(body)
        conversation = from_anthropic(body, limits)
        if (body.get("tool_choice") or {}).get("type") == "none":
            conversation.tools = []
        if body.get("stream"):
            turn = session.turn_stream(conversation, turn_params)
            prompt_tokens = await anext(turn)  # the bounds are checked: a request past one gets its 4xx
            return StreamingResponse(anthropic_api.live_events(turn, prompt_tokens, session.model),
                                     media_type="text/event-stream")
        result = await session.turn(conversation, turn_params)
        return JSONResponse(anthropic_api.message(result, session.model))

    @app.get("/v1/session")
    async def session_state(request: Request) -> dict[str, Any]:
        session = session_of(request)
        return {"id": session.id, "turns": session.num_turns, "reward": session.reward,
                "branches": [{"turn": b.turn, "reason": b.reason} for b in session.trajectory.branches]}

    @app.post("/v1/session/reward")
    async def set_reward(request: Request) -> dict[str, Any]:
        session = session_of(request)
        body = await _read_json(request, 4096)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise InvalidArgument(f"reward must be a finite number, got {reward!r}")
        session.reward = float(reward)
        return {"id": session.id, "reward": session.reward}

    return app
