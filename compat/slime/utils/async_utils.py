"""slime.utils.async_utils: `run(coro)` blocks until a coroutine is done. Inside a rollout function the rollout
service runs, the coroutine runs on the service's event loop (where its router client lives); elsewhere on one
background loop, as slime does."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from services.rollout.generation.rollout_function import service_loop

__all__ = ["get_async_loop", "run"]


class AsyncLoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_loop_thread: AsyncLoopThread | None = None
_lock = threading.Lock()


def get_async_loop() -> AsyncLoopThread:
    global _loop_thread
    with _lock:
        if _loop_thread is None:
            _loop_thread = AsyncLoopThread()
    return _loop_thread


def run(coro: Coroutine) -> Any:
    """Run a coroutine to its end from synchronous code (never from the loop it would run on)."""
    loop = service_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is not None and running is loop:
        raise RuntimeError("slime.utils.async_utils.run: called on the event loop it would run on; await it instead")
    if loop is not None:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()
    return get_async_loop().run(coro)
