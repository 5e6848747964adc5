"""Serve a FastAPI app with uvicorn inside the running asyncio loop, beside a gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.common import auth
from services.common.errors import InvalidArgument
from services.common.strict_json import StrictJsonBodies


class RestServer:
    """A uvicorn server on a socket bound up front, so port 0 gives a known free port."""

    def __init__(self, app, host: str, port: int) -> None:
        # proto IPPROTO_TCP: only then does asyncio set TCP_NODELAY on accepted connections (else +40 ms replies)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.server.capture_signals = contextlib.nullcontext  # the service's main owns signals
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


def create_rest_app(title: str, description: str, token: str = "", service: str = "") -> FastAPI:
    """A service's FastAPI app with what every one has: GET /healthz, InvalidArgument as HTTP 400, a body that is not
    plain JSON (NaN, 1e999999, a lone surrogate) as HTTP 400, and, given a token, 401 on every path but health,
    metrics and docs without `Authorization: Bearer <token>`."""
    app = FastAPI(title=title, description=description)
    app.add_middleware(StrictJsonBodies)  # added first: the token check (outermost) runs before a body is read
    auth.require_bearer(app, token, service or title)

    @app.exception_handler(InvalidArgument)
    async def invalid_argument(request, err: InvalidArgument) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(err)})

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
