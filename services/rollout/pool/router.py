"""The real sglang-router's worker API: register or remove workers, list them (../local.py starts a router process).

Only /generate goes through the router; admin calls (pause, abort, weight updates) go to each engine directly.
"""

from __future__ import annotations

import time

import httpx

from services.common import auth
from services.common.errors import DeadlineExceeded, FailedPrecondition, NotFound, Unavailable
from services.common.http_client import HttpClient


class RouterClient(HttpClient):
    """Worker management of one sglang-router ("http://127.0.0.1:30000"); every call has a timeout and, when this
    process holds the router token, the bearer the router's control plane checks (only the manager holds it)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        super().__init__(url, timeout_s, headers=auth.bearer(auth.read_token("router")))

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            reply = self.http.request(method, path, json=body)
        except httpx.TransportError as err:
            raise _transport_error(self.url, method, path, self.timeout_s, err) from err
        return _reply_json(self.url, method, path, reply)

    def live(self) -> bool:
        """The router process answers (GET /liveness)."""
        try:
            return self.http.get("/liveness").status_code == 200
        except httpx.HTTPError:
            return False

    def ready(self) -> bool:
        """At least one worker is registered and healthy (GET /readiness)."""
        try:
            return self.http.get("/readiness").status_code == 200
        except httpx.HTTPError:
            return False

    def list_workers(self) -> list[dict]:
        """GET /workers: [{"id", "url", "is_healthy", "model_id", ...}]."""
        return self._request("GET", "/workers").get("workers", [])

    def worker_urls(self) -> list[str]:
        return [w["url"].rstrip("/") for w in self.list_workers()]

    def find_worker(self, url: str) -> dict | None:
        url = url.rstrip("/")
        return next((w for w in self.list_workers() if w.get("url", "").rstrip("/") == url), None)

    def post_worker(self, url: str) -> None:
        """POST /workers: queue the registration of url (202); the router lists it once it answered its probes."""
        self._request("POST", "/workers", {"url": url.rstrip("/")})

    def delete_worker(self, worker_id: str) -> None:
        """DELETE /workers/{id}: queue the removal (202); the router stops listing it about a second later."""
        self._request("DELETE", f"/workers/{worker_id}")

    def add_worker(self, url: str, timeout_s: float = 30.0) -> dict:
        """Register url and wait until the router lists it healthy; idempotent.

        POST /workers only queues the job (202) and never reports failure, so poll GET /workers.
        """
        url = url.rstrip("/")
        worker = self.find_worker(url)
        if worker is None:
            self.post_worker(url)
        deadline = time.monotonic() + timeout_s
        while True:
            worker = self.find_worker(url)
            if worker is not None and worker.get("is_healthy"):
                return worker
            if time.monotonic() >= deadline:
                state = "listed but unhealthy" if worker else "not listed"
                raise DeadlineExceeded(f"router {self.url}: worker {url} {state} {timeout_s} s after POST /workers "
                                       f"(does it answer /health, /server_info and /model_info?)")
            time.sleep(0.2)

    def remove_worker(self, url: str, timeout_s: float = 10.0) -> None:
        """DELETE /workers/{id} (the id looked up by url); returns once the router no longer lists it."""
        worker = self.find_worker(url)
        if worker is None:
            raise NotFound(f"router {self.url}: no worker {url.rstrip('/')} to remove")
        self.delete_worker(worker["id"])
        deadline = time.monotonic() + timeout_s
        while self.find_worker(url) is not None:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"router {self.url}: worker {url} still listed {timeout_s} s after DELETE")
            time.sleep(0.1)


class AsyncRouterClient:
    """The router's worker list for code on an event loop (the generation loop): RouterClient's GET /workers,
    without blocking the loop; `transport` lets tests script the router."""

    def __init__(self, url: str, timeout_s: float = 10.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, transport=transport,
                                      headers=auth.bearer(auth.read_token("router")))

    async def worker_urls(self) -> list[str]:
        try:
            reply = await self.http.get("/workers")
        except httpx.TransportError as err:
            raise _transport_error(self.url, "GET", "/workers", self.timeout_s, err) from err
        return [w["url"].rstrip("/") for w in _reply_json(self.url, "GET", "/workers", reply).get("workers", [])]

    async def close(self) -> None:
        await self.http.aclose()


def _transport_error(url: str, method: str, path: str, timeout_s: float, err: httpx.TransportError) -> Exception:
    if isinstance(err, httpx.TimeoutException):
        return DeadlineExceeded(f"router {url}: no {method} {path} reply in {timeout_s} s")
    return Unavailable(f"router {url}: {method} {path}: {type(err).__name__}: {err}")


def _reply_json(url: str, method: str, path: str, reply: httpx.Response) -> dict:
    if reply.status_code >= 400:
        raise FailedPrecondition(f"router {url}: {method} {path} -> HTTP {reply.status_code}: {reply.text[:500]}")
    try:
        return reply.json()
    except ValueError as err:
        raise FailedPrecondition(f"router {url}: {method} {path}: not JSON: {reply.text[:200]!r}") from err
