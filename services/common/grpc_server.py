"""gRPC server plumbing shared by every service: health, reflection, error mapping, graceful stop.

Servicers stay thin: decorate each RPC with `handle_errors` and raise Physarum errors from domain code.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth import TokenGuard
from services.common.errors import PhysarumError
from services.common.grpc_guard import DecodeGuard

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, err: Exception, name: str) -> None:
    if isinstance(err, PhysarumError):
        await context.abort(err.code, str(err))
    log.exception("%s failed", name)
    await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error: {type(err).__name__}: {err}")


def handle_errors(method: Callable) -> Callable:
    """Map Physarum errors raised inside an RPC to their status codes; anything else is INTERNAL, logged."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as err:  # noqa: BLE001 - mapped at the edge, once
                await _abort(context, err, name)
        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as err:  # noqa: BLE001 - mapped at the edge, once
            await _abort(context, err, name)
    return unary_wrapper


@dataclass
class ServiceBinding:
    """A servicer with the generated function that adds it and its full name ("physarum.v1.Buffer")."""

    add_to_server: Callable
    servicer: object
    full_name: str


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    port: int
    health: health.HealthServicer
    service_names: list[str]
    _pending: asyncio.Future | None = None

    def set_serving(self, serving: bool) -> asyncio.Future:
        """Report SERVING or NOT_SERVING for every service; call it inside the loop, await it if you need to."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def apply() -> None:
            for name in ["", *self.service_names]:
                await self.health.set(name, status)

        self._pending = asyncio.ensure_future(apply())
        return self._pending


async def start_grpc_server(bindings: Iterable[ServiceBinding], host: str, port: int,
                            serving: bool = True, token: str = "", service: str = "") -> GrpcServer:
    """Start an aio server on host:port (0 picks a free port) with health and reflection; given a token, every RPC
    but health and reflection needs it as `authorization: Bearer <token>` metadata."""
    bindings = list(bindings)
    guards = [TokenGuard(token, service or bindings[0].full_name)] if token else []
    server = grpc.aio.server(interceptors=[*guards, DecodeGuard()],
                             options=[("grpc.max_receive_message_length", 256 << 20),
                                      ("grpc.max_send_message_length", 256 << 20)])
    for binding in bindings:
        binding.add_to_server(binding.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [b.full_name for b in bindings]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    result = GrpcServer(server=server, port=bound, health=health_servicer, service_names=names)
    await result.set_serving(serving)
    return result


async def wait_for_stop_signal() -> None:
    """Return on SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def stop_grpc_server(server: GrpcServer, grace_s: float) -> None:
    """Report NOT_SERVING, then let in-flight calls finish for up to grace_s."""
    await server.set_serving(False)
    await server.server.stop(grace_s)
