"""The gateway's HTTP API (FastAPI): /v1/chat/completions, /v1/responses, /v1/models, /v1/messages, and the
session's own /v1/session (its state), /v1/session/reward and /v1/session/spawn (a sub-agent's session). Each
request's key (Authorization: Bearer, or x-api-key) opens its own session and no other; bodies are bounded before
they are read, then parsed and checked against their API's schema (schema.py) in the worker pool, off the event
loop; errors come in each API's error shape.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, PhysarumError, Unavailable
from services.rollout.gateway import anthropic_api, openai_api, responses_api, schema
from services.rollout.gateway.conversation import Conversation, Limits, from_anthropic, from_openai, from_responses
from services.rollout.gateway.sessions import Session, SessionRegistry, TurnParams

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


async def _read_body(request: Request, max_bytes: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise BodyTooLarge(f"request body of {length} bytes, at most {max_bytes}")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > max_bytes:
            raise BodyTooLarge(f"request body over {max_bytes} bytes")
    return bytes(data)


def _error(request: Request, status: int, kind: str, message: str, param: str | None = None) -> JSONResponse:
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(status_code=status, content={"type": "error", "error": {"type": kind, "message": message}})
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": None}})


_HTTP_KINDS = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large"}


REWARD = schema.Obj({"reward": schema.num(null=False)}, required=("reward",))


def openai_request(data: bytes, limits: Limits) -> tuple[dict[str, Any], TurnParams, Conversation]:
    """A Chat Completions body checked whole (the worker pool: parsing a large body is no work for the event loop)."""
    body = schema.parse(data, schema.OPENAI_CHAT)
    return body, openai_api.params(body), from_openai(body, limits)


def responses_request(data: bytes, limits: Limits, session: Session) -> tuple[dict[str, Any], TurnParams,
                                                                               Conversation]:
    """A Responses body checked whole, after the session's previous response when it names one."""
    body = schema.parse(data, schema.OPENAI_RESPONSES)
    turn_params = responses_api.params(body)
    return body, turn_params, from_responses(body, limits, *responses_api.history(
        session, body.get("previous_response_id")))


def anthropic_request(data: bytes, limits: Limits) -> tuple[dict[str, Any], TurnParams, Conversation]:
    body = schema.parse(data, schema.ANTHROPIC_MESSAGES)
    return body, anthropic_api.params(body), from_anthropic(body, limits)


def create_app(registry: SessionRegistry) -> FastAPI:
    app = FastAPI(title="Physarum agent gateway",
                  description="OpenAI (Chat Completions, Responses) and Anthropic APIs over one session per sample")
    limits = registry.limits

    # Handlers for these classes (not for Exception, whose handler Starlette runs and then re-raises, dropping the
    # kept-alive connection under the client's next request); anything else is FastAPI's plain 500.
    # Messages are the gateway's own (schema.py, conversation.py, sessions.py): none names an engine, the router or a
    # job; the engines' and the router's errors are logged and answered in general terms (sessions.py).
    async def errors(request: Request, err: Exception) -> JSONResponse:
        if isinstance(err, BodyTooLarge):
            return _error(request, 413, "request_too_large", str(err))
        if isinstance(err, InvalidArgument):
            return _error(request, 400, "invalid_request_error", str(err), getattr(err, "param", None))
        if isinstance(err, (Unauthorized, NotFound)):
            return _error(request, 401, "authentication_error", f"invalid API key: {err}")
        if isinstance(err, FailedPrecondition):
            return _error(request, 409, "invalid_request_error", str(err))
        if isinstance(err, Unavailable):
            return _error(request, 503, "overloaded_error", str(err))
        log.error("gateway %s failed", request.url.path, exc_info=err)
        return _error(request, 500, "api_error", "the gateway failed on this request; its log has the details")

    async def http_errors(request: Request, err: Exception) -> JSONResponse:
        status = getattr(err, "status_code", 400)
        return _error(request, status, _HTTP_KINDS.get(status, "invalid_request_error"), str(getattr(err, "detail",
                                                                                                  err)))

    for kind in (PhysarumError, Unauthorized):
        app.add_exception_handler(kind, errors)
    app.add_exception_handler(StarletteHTTPException, http_errors)  # 404, 405 in the API's shape

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
        body, turn_params, conversation = await registry.in_pool(openai_request, await _read_body(
            request, limits.max_body_bytes), limits)
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

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        session = session_of(request)
        body, turn_params, conversation = await registry.in_pool(responses_request, await _read_body(
            request, limits.max_body_bytes), limits, session)
        if body.get("tool_choice") == "none":
            conversation.tools = []
        response_id = responses_api.new_id()

        def keep(result: Any, message_id: str) -> None:
            if body.get("store") is not False:  # as OpenAI: a response not stored cannot be continued by its id
                responses_api.keep(session, response_id, conversation, bool(body.get("instructions")),
                                   result.choices[0])

        if body.get("stream"):
            turn = session.turn_stream(conversation, turn_params)
            await anext(turn)  # the bounds are checked: a request past one gets its 4xx, not a stream
            return StreamingResponse(responses_api.live_events(turn, response_id, body, session.model, keep),
                                     media_type="text/event-stream")
        result = await session.turn(conversation, turn_params)
        keep(result, "")
        return JSONResponse(responses_api.response(response_id, body, session.model, result))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        session = session_of(request)
        body, turn_params, conversation = await registry.in_pool(anthropic_request, await _read_body(
            request, limits.max_body_bytes), limits)
        if isinstance(body.get("tool_choice"), dict) and body["tool_choice"]["type"] == "none":
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

    @app.post("/v1/session/spawn")
    async def spawn(request: Request) -> dict[str, Any]:
        """A sub-agent's session (or a restart's): the same sample's, with its own key; a sample of its own."""
        child = registry.spawn(session_of(request))
        return {"id": child.id, "api_key": child.key}

    @app.post("/v1/session/reward")
    async def set_reward(request: Request) -> dict[str, Any]:
        session = session_of(request)
        body = schema.parse(await _read_body(request, 4096), REWARD)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise InvalidArgument(f"reward must be a finite number, got {reward!r}")
        session.reward = float(reward)
        return {"id": session.id, "reward": session.reward}

    return app
