"""The HTTP client the manager sends /generate through: aiohttp with kept-alive connections to the router.

Why not httpx: at 256 concurrent /generate through sglang-router, httpx with keep-alive stalls for seconds (37
requests/s with 64 simulated engines) and without keep-alive pays a connection per request (278/s); aiohttp with
keep-alive sustains 2,000+ on the same machine (bench/control_plane.py prints the side-by-side figures). An httpx
client (a scripted MockTransport in tests) fits the same interface through HttpxPoster.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import orjson

JSON_HEADERS = {"Content-Type": "application/json"}
IDLE_CLOSE_S = 10.0


class PostError(Exception):
    """The request did not get an HTTP answer (connection refused or reset, timeout): another try may succeed."""


@dataclass(frozen=True)
class PostReply:
    status_code: int
    text: str

    def json(self) -> Any:
        try:
            return orjson.loads(self.text)  # a batch's replies: several times faster than json.loads
        except orjson.JSONDecodeError:
            return json.loads(self.text)  # what orjson refuses and json reads (NaN, Infinity), or its error


class Poster(Protocol):
    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> PostReply: ...

    def stream(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
               ) -> AsyncIterator[str]: ...

    async def aclose(self) -> None: ...


class StreamError(PostError):
    """A streamed request answered with an HTTP error before any event (its status code and body)."""

    def __init__(self, status_code: int, text: str) -> None:
        super().__init__(f"HTTP {status_code}: {text[:500]}")
        self.status_code = status_code


def _sse_data(line: str) -> str | None:
    """The payload of a server-sent event's `data:` line; None for any other line."""
    return line[5:].strip() if line.startswith("data:") else None


class AiohttpPoster:
    """A pool of up to `max_connections` kept-alive connections; the session is made on first use, inside the event
    loop that uses it (aiohttp binds a session to its loop)."""

    def __init__(self, max_connections: int, timeout_s: float, connect_timeout_s: float = 5.0) -> None:
        self.max_connections, self.timeout_s, self.connect_timeout_s = max_connections, timeout_s, connect_timeout_s
        self._session: Any = None

    def _get_session(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            # idle connections close after 10 s, before the router's own idle limit can close one under a request
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0,
                                             keepalive_timeout=IDLE_CLOSE_S)
            # sock_read bounds each wait for the router (as httpx's read timeout did), not the pool queue
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=self.timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._session

    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> PostReply:
        import aiohttp

        data = json.dumps(body, separators=(",", ":")).encode()
        try:
            async with self._get_session().post(url, data=data, headers={**JSON_HEADERS, **(headers or {})}) as reply:
                return PostReply(reply.status, await reply.text())
        except (TimeoutError, aiohttp.ClientError) as err:
            raise PostError(f"POST {url}: {type(err).__name__}: {err}") from err

    async def stream(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
                     ) -> AsyncIterator[str]:
        """POST `body` and yield the `data:` payloads of the server-sent events as they arrive (SGLang's stream)."""
        import aiohttp

        data = json.dumps(body, separators=(",", ":")).encode()
        try:
            async with self._get_session().post(url, data=data, headers={**JSON_HEADERS, **(headers or {})}) as reply:
                if reply.status != 200:
                    raise StreamError(reply.status, await reply.text())
                async for raw in reply.content:
                    if (payload := _sse_data(raw.decode())) is not None:
                        yield payload
        except (TimeoutError, aiohttp.ClientError) as err:
            raise PostError(f"POST {url} (stream): {type(err).__name__}: {err}") from err

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class HttpxPoster:
    """The same interface over an httpx client (tests script the router with httpx.MockTransport)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def post(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> PostReply:
        try:
            reply = await self.http.post(url, json=body, headers=headers)
        except httpx.TransportError as err:
            raise PostError(f"POST {url}: {type(err).__name__}: {err}") from err
        return PostReply(reply.status_code, reply.text)

    async def stream(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
                     ) -> AsyncIterator[str]:
        try:
            async with self.http.stream("POST", url, json=body, headers=headers) as reply:
                if reply.status_code != 200:
                    raise StreamError(reply.status_code, (await reply.aread()).decode(errors="replace"))
                async for line in reply.aiter_lines():
                    if (payload := _sse_data(line)) is not None:
                        yield payload
        except httpx.TransportError as err:
            raise PostError(f"POST {url} (stream): {type(err).__name__}: {err}") from err

    async def aclose(self) -> None:
        await self.http.aclose()
