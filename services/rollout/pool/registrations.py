"""The router's side of the engine pool: which engine URLs sglang-router lists (id, health, load), registering and
removing them. POST and DELETE /workers only queue work in the router, so both sides are checked against its listing,
refreshed once per pool tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.rollout.pool.router import RouterClient

log = logging.getLogger(__name__)

REPOST_S = 10.0  # POST /workers again if the router still does not list the URL
QUEUED_POST_S = 2.0  # a POST this recent may still turn into a listing
DEREGISTER_TIMEOUT_S = 10.0


class Registrations:
    """Registration of the pool's engines with one router; `blocking(fn, *args)` runs a RouterClient call off-loop."""

    def __init__(self, router: RouterClient, blocking: Callable[..., Awaitable], poll_s: float,
                 own_router: bool = False) -> None:
        self.router = router
        self.own_router = own_router  # remove foreign workers too (this pool is the router's only registrar)
        self.blocking = blocking
        self.poll_s = poll_s
        self.workers: dict[str, dict] = {}  # url -> the router's worker, as of the last refresh
        self.posted: dict[str, float] = {}  # url -> when POST /workers was sent, until the router lists it
        self.ever_posted: set[str] = set()
        self.deleted_ids: set[str] = set()  # DELETE sent, still listed

    async def refresh(self, owned: set[str]) -> None:
        """Read GET /workers; remove workers no engine in `owned` has: those this pool registered before and, when
        it owns the router, foreign ones too (a worker someone else registered would get requests)."""
        workers = await self.blocking(self.router.list_workers)
        self.workers = {str(w.get("url", "")).rstrip("/"): w for w in workers}
        self.deleted_ids &= {str(w.get("id")) for w in workers}
        for url in self.workers:  # the POST took effect
            self.posted.pop(url, None)
        for url, worker in self.workers.items():
            mine = url in self.ever_posted or self.own_router
            if mine and url not in owned and url not in self.posted and str(worker.get("id")) not in self.deleted_ids:
                if url in self.ever_posted:
                    log.info("router still lists %s, which left the pool: removing it", url)
                else:
                    log.warning("router lists %s, which this pool never registered: removing it", url)
                await self._delete(str(worker["id"]))

    def listed(self, url: str) -> bool:
        return url in self.workers

    def healthy(self, url: str) -> bool:
        return bool(self.workers.get(url, {}).get("is_healthy"))

    def load(self, url: str) -> int:
        return max(int(self.workers.get(url, {}).get("load") or 0), 0)

    def registered(self, url: str) -> bool:
        """Listed, or a POST is on its way."""
        return url in self.workers or url in self.posted

    def inherit(self, urls: set[str]) -> None:
        """URLs an earlier pool registered (its manager was killed): each refresh removes them like this pool's own
        former engines, unless an engine of this pool has the URL."""
        self.ever_posted |= urls

    async def register(self, url: str) -> None:
        """POST /workers unless listed or posted lately; the router lists the URL once its probes pass."""
        if url in self.workers or time.monotonic() - self.posted.get(url, float("-inf")) < REPOST_S:
            return
        await self.blocking(self.router.post_worker, url)
        self.posted[url] = time.monotonic()
        self.ever_posted.add(url)

    async def _delete(self, worker_id: str) -> None:
        self.deleted_ids.add(worker_id)
        await self.blocking(self.router.delete_worker, worker_id)

    async def deregister(self, url: str) -> None:
        """Remove `url`; returns once a refresh (by the pool's controller) no longer lists it, or after a timeout."""
        deadline = time.monotonic() + DEREGISTER_TIMEOUT_S
        while url in self.workers or time.monotonic() - self.posted.get(url, float("-inf")) < QUEUED_POST_S:
            worker_id = str(self.workers.get(url, {}).get("id", ""))
            if worker_id and worker_id not in self.deleted_ids:
                await self._delete(worker_id)
            if time.monotonic() > deadline:
                log.warning("router %s still lists %s %.0f s after DELETE", self.router.url, url, DEREGISTER_TIMEOUT_S)
                break
            await asyncio.sleep(self.poll_s)
        self.posted.pop(url, None)

    async def deregister_all(self, urls: set[str]) -> None:
        """Without the controller (on close): DELETE every worker at `urls`, then wait until none is listed."""
        deadline = time.monotonic() + DEREGISTER_TIMEOUT_S
        while time.monotonic() < deadline:
            workers = [w for w in await self.blocking(self.router.list_workers)
                       if str(w.get("url", "")).rstrip("/") in urls]
            if not workers:
                return
            for worker in workers:
                if str(worker["id"]) not in self.deleted_ids:
                    await self._delete(str(worker["id"]))
            await asyncio.sleep(0.2)
        log.warning("router %s still lists some of %s", self.router.url, sorted(urls))
