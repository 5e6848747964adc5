"""Stopping a rollout's surplus groups once its batch is full: tell every engine to abort, and keep what the aborted
groups generated (partial_rollout) or cancel them. The manager decides when, and gives the prompts back.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from services.common.errors import PhysarumError
from services.common.samples import Prompt
from services.common.sglang import AsyncSGLangClient
from services.rollout.generation.groups import Generation
from services.rollout.generation.partial import PartialGroups
from services.rollout.pool.router import AsyncRouterClient

log = logging.getLogger(__name__)

ABORT_REPEAT_S = 3.0  # while draining, engines are told to abort again this often (late requests)
DRAIN_TIMEOUT_S = 60.0  # drained groups still running after this are cancelled
ABORT_TIMEOUT_S = 10.0


class EngineAborter:
    """Aborts every request on every engine the router lists (the router itself has no /abort_request)."""

    def __init__(self, router_url: str, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.router = AsyncRouterClient(router_url, timeout_s=ABORT_TIMEOUT_S, transport=transport)
        self.engines = AsyncSGLangClient(timeout_s=ABORT_TIMEOUT_S, transport=transport)

    async def abort_all(self, what: str) -> None:
        """Best effort: failures are logged (`what` names the rollout), never raised."""
        try:
            urls = await self.router.worker_urls()
        except PhysarumError as err:
            log.warning("%s: could not list the router's workers to abort them: %s", what, err)
            return
        replies = await asyncio.gather(*(self.engines.abort_request(url, abort_all=True) for url in urls),
                                       return_exceptions=True)
        for url, reply in zip(urls, replies, strict=True):
            if isinstance(reply, BaseException):
                log.warning("%s: engine %s: /abort_request failed: %s", what, url, reply)

    async def close(self) -> None:
        await asyncio.gather(self.router.close(), self.engines.close())


async def drain_surplus(gen: Generation, rollout_id: int, pending: dict[asyncio.Task, Prompt], aborter: EngineAborter,
                        partial: PartialGroups) -> None:
    """Abort the groups in `pending`. With partial_rollout, wait for them to stop and keep what they generated
    (partial.py); otherwise cancel them."""
    config, what = gen.config, gen.ctx.name
    gen.ctx.aborting = True
    if not config.partial_rollout:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await aborter.abort_all(what)
        return
    await aborter.abort_all(what)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    waiting = set(pending)
    while waiting:
        _, waiting = await asyncio.wait(waiting, timeout=max(0.0, min(ABORT_REPEAT_S, deadline - time.monotonic())))
        if waiting and time.monotonic() >= deadline:
            log.warning("%s: %d drained groups still running after %.0f s: cancelled", what, len(waiting),
                        DRAIN_TIMEOUT_S)
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            break
        if waiting:
            await aborter.abort_all(what)  # requests that reached an engine after the last abort
    num_kept = sum(partial.keep(config.job_id, prompt, task.result(), rollout_id)
                   for task, prompt in pending.items() if not task.cancelled() and task.exception() is None)
    log.info("%s: kept %d partial groups of %d drained (%d kept in all)", what, num_kept, len(pending), len(partial))
