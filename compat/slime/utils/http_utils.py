"""slime.utils.http_utils: `post` and `get` with slime's contract (JSON in, parsed JSON out; `post` retries any
failure up to max_retries times, one second apart) over one pooled httpx client per event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

import httpx

log = logging.getLogger(__name__)
_clients: dict[int, httpx.AsyncClient] = {}
RETRY_DELAY_S = 1.0


def _client() -> httpx.AsyncClient:
    loop_id = id(asyncio.get_running_loop())
    client = _clients.get(loop_id)
    if client is None or client.is_closed:
        client = _clients[loop_id] = httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False,
                                                       limits=httpx.Limits(max_connections=1024))
    return client


def _parse(content: bytes) -> Any:
    try:
        return json.loads(content)
    except json.JSONDecodeError:
        return content.decode()


async def post(url: str, payload: Any, max_retries: int = 60, headers: dict[str, str] | None = None) -> Any:
    """POST payload as JSON; the reply's JSON (or its text when it is not JSON). Raises the last error."""
    for attempt in range(1, max_retries + 1):
        try:
            reply = await _client().post(url, json=payload or {}, headers=headers)
            reply.raise_for_status()
            return _parse(reply.content)
        except Exception as err:  # noqa: BLE001 - slime retries whatever failed
            detail = err.response.text[:300] if isinstance(err, httpx.HTTPStatusError) else ""
            if attempt >= max_retries:
                raise
            log.info("post %s failed (%s %s), retry %d/%d", url, type(err).__name__, detail, attempt, max_retries)
            await asyncio.sleep(RETRY_DELAY_S)
    raise ValueError(f"post {url}: max_retries must be >= 1, got {max_retries}")


async def get(url: str) -> Any:
    reply = await _client().get(url)
    reply.raise_for_status()
    return json.loads(reply.content)


def is_port_available(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def find_available_port(base_port: int) -> int:
    port = base_port
    while not is_port_available(port):
        port += 1
    return port
