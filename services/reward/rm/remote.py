"""slime's `remote_rm`: POST {"prompt", "response", "label"} to the job's rm_url and use the JSON reply (a number,
or a dict that reward_key picks from). Transport errors and 5xx replies retry with backoff; the caller's per-sample
timeout bounds the whole exchange."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import httpx

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 10  # slime's max_retries
_clients: dict[int, httpx.AsyncClient] = {}


def _client() -> httpx.AsyncClient:
    """One pooled client per event loop (the service runs one; tests may run several)."""
    loop_id = id(asyncio.get_running_loop())
    client = _clients.get(loop_id)
    if client is None or client.is_closed:
        client = _clients[loop_id] = httpx.AsyncClient(timeout=120.0, limits=httpx.Limits(max_connections=64))
    return client


async def remote_reward(url: str, prompt: Any, response: str, label: Any, *, attempts: int = MAX_ATTEMPTS,
                        base_delay_s: float = 0.5) -> Any:
    """The RM's JSON reply; raises the last error once `attempts` tries failed, at once for a 4xx."""
    if not url:
        raise ValueError("rm_type remote_rm needs rm_url (the reward model's HTTP endpoint)")
    payload = {"prompt": prompt, "response": response, "label": label}
    for attempt in range(1, attempts + 1):
        try:
            reply = await _client().post(url, json=payload)
            if reply.status_code < 500:
                reply.raise_for_status()
                return reply.json()
            reply.raise_for_status()
        except httpx.HTTPStatusError as err:
            if err.response.status_code < 500 or attempt == attempts:
                raise
            error: Exception = err
        except httpx.TransportError as err:
            if attempt == attempts:
                raise
            error = err
        delay_s = min(base_delay_s * 2 ** (attempt - 1), 30.0) + random.random() * base_delay_s
        log.info("remote_rm %s: %s; retry %d/%d in %.1f s", url, type(error).__name__, attempt, attempts, delay_s)
        await asyncio.sleep(delay_s)
    raise AssertionError("unreachable")
