"""Per-service bearer tokens: one scheme for every gRPC and REST port of Physarum.

Each callee service has a token (buffer, reward, rollout, engine, and the router's worker list; the trainer's job API
keeps its api_token). A
process reads tokens only from files in PHYSARUM_TOKEN_DIR, `<service>.token`: a server reads its own, a client the
one of the service it calls, so a process holds exactly the tokens of what it may call (the chart mounts those keys
of one Secret, `physarum up` writes one directory per process). Tokens never travel in an environment variable.
No file: that service runs without authentication (in-process tests). Health, readiness, metrics and API docs stay
open. What each token admits is left to the servers that check it.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

from services.common.errors import Unauthenticated

log = logging.getLogger(__name__)

TOKEN_DIR_ENV = "PHYSARUM_TOKEN_DIR"
SERVICES = ("buffer", "reward", "rollout", "engine", "router", "trainer")
# gRPC methods anyone may call: health checks and reflection.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# REST paths anyone may call: health and readiness, metrics, API docs.
OPEN_PATHS = frozenset({"/healthz", "/health", "/health_generate", "/readyz", "/metrics", "/docs", "/openapi.json",
                        "/docs/oauth2-redirect"})


def token_path(service: str, token_dir: str | Path | None = None) -> Path | None:
    directory = token_dir if token_dir is not None else os.environ.get(TOKEN_DIR_ENV, "")
    return Path(directory) / f"{service}.token" if directory else None


def read_token(service: str, token_dir: str | Path | None = None) -> str:
    """The token of `service` from the token directory; "" when there is none (authentication off)."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
    path = token_path(service, token_dir)
    if path is None or not path.is_file():
        return ""
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def bearer(token: str) -> dict[str, str]:
    """The HTTP header that carries `token` (none when it is empty)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def check_bearer(authorization: str | None, token: str, what: str) -> None:
    """Unauthenticated unless `authorization` is "Bearer <token>"; an empty token admits everyone."""
    if not token:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthenticated(f"{what}: missing or wrong bearer token (send `authorization: Bearer <token>`)")


def write_tokens(token_dir: Path, services: Iterable[str] = SERVICES) -> dict[str, Path]:
    """Generate a fresh random token per service in token_dir (mode 0600); returns their paths."""
    token_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(token_dir, 0o700)
    paths = {}
    for service in services:
        path = token_dir / f"{service}.token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32))
        paths[service] = path
    return paths


def grant(source_dir: Path, target_dir: Path, services: Iterable[str]) -> Path:
    """A directory for one process holding copies of the named services' tokens only; returns it."""
    target_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(target_dir, 0o700)
    for service in services:
        data = (source_dir / f"{service}.token").read_bytes()
        fd = os.open(target_dir / f"{service}.token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    return target_dir


class TokenGuard(grpc.aio.ServerInterceptor):
    """Every RPC but health and reflection needs `authorization: Bearer <token>` metadata."""

    def __init__(self, token: str, service: str) -> None:
        self.token = token
        self.service = service

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method
        if method.startswith(OPEN_GRPC_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            check_bearer(metadata.get("authorization"), self.token, f"{self.service} {method}")
        except Unauthenticated as err:
            log.warning("refused: %s", err)
            return _refusal(str(err))
        return await continuation(handler_call_details)


def _refusal(message: str) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request (works for every RPC shape)."""
    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=lambda data: None)


def require_bearer(app, token: str, service: str, open_paths: Iterable[str] = OPEN_PATHS) -> None:
    """Make a FastAPI app answer 401 to any path outside `open_paths` without the bearer token (no-op if empty)."""
    if not token:
        return
    from fastapi import Request
    from fastapi.responses import JSONResponse

    open_paths = frozenset(open_paths)

    @app.middleware("http")
    async def bearer_middleware(request: Request, call_next):
        if request.url.path not in open_paths:
            try:
                check_bearer(request.headers.get("authorization"), token, f"{service} {request.url.path}")
            except Unauthenticated as err:
                log.warning("refused: %s", err)
                return JSONResponse({"detail": str(err)}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)


def engine_env(engine_dir: Path) -> dict[str, str]:
    """The environment a launcher gives local engines: a token directory holding the engine token only (none when
    this process has no engine token)."""
    token_dir = os.environ.get(TOKEN_DIR_ENV, "")
    if not read_token("engine"):
        return {}
    return {TOKEN_DIR_ENV: str(grant(Path(token_dir), engine_dir, ["engine"]))}
