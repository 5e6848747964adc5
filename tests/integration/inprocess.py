"""The rollout manager inside the test process, on an event loop of its own in a daemon thread, so a test can reach
into its engine pool while the other services run as processes."""

from __future__ import annotations

import asyncio
import threading

from services.rollout.config import RolloutManagerConfig
from services.rollout.server import create_server


class InProcessManager:
    def __init__(self, config: RolloutManagerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="manager-loop", daemon=True)
        self.thread.start()
        self.server = self.call(create_server(config))
        self.pool = self.server.pool

    def call(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Until the pool's initial engines serve (the service's health turns SERVING)."""
        async def ready() -> None:
            await asyncio.shield(self.server.pool_start)
        self.call(ready(), timeout_s)

    def stop(self) -> None:
        try:
            self.call(self.server.stop(2.0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
