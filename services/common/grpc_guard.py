"""A server interceptor that turns a request gRPC cannot decode into INVALID_ARGUMENT before any servicer runs.

Without it the generated deserializer's exception reaches the library, which answers UNKNOWN; a client then cannot
tell a malformed message from a server bug. Servicers see only decoded messages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Undecodable:
    """What the guarded deserializer hands on instead of raising."""

    reason: str


def _safe(deserialize: Callable | None, method: str) -> Callable | None:
    if deserialize is None:
        return None

    def decode(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as err:  # noqa: BLE001 - any decoding failure is the caller's malformed message
            return _Undecodable(f"{method}: cannot decode the request ({len(data)} bytes): {type(err).__name__}")
    return decode


async def _refuse(context: grpc.aio.ServicerContext, request: _Undecodable) -> None:
    log.info("refused: %s", request.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


def _guard_unary(behavior: Callable) -> Callable:
    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)
    return unary


def _guard_stream(behavior: Callable) -> Callable:
    async def stream(request, context):
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        async for item in behavior(request, context):
            yield item
    return stream


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Unary-request RPCs whose message does not decode answer INVALID_ARGUMENT naming the method."""

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        decode = _safe(handler.request_deserializer, method)
        if handler.unary_unary is not None:
            return handler._replace(request_deserializer=decode, unary_unary=_guard_unary(handler.unary_unary))
        return handler._replace(request_deserializer=decode, unary_stream=_guard_stream(handler.unary_stream))
