"""Coalescing of concurrent calls into one: what many tasks submit while a call is under way goes out together in the
next. At 64 engines the groups of a rollout finish within milliseconds of each other, and one gRPC call per group
(to the reward service, a thread hop each) costs more than the generation itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    """`await submit(item)` returns flush([..., item, ...])'s result for the item. One flush runs at a time; it takes
    every item queued (at most max_items, counted by `size`). A flush that raises raises in every caller of its
    batch; a caller cancelled while waiting leaves the batch going for the others."""

    def __init__(self, flush: Callable[[list[T]], Awaitable[Sequence[R]]], max_items: int,
                 size: Callable[[T], int] = lambda item: 1) -> None:
        if max_items < 1:
            raise ValueError(f"Batcher: max_items must be >= 1, got {max_items}")
        self.flush, self.max_items, self.size = flush, max_items, size
        self.queue: list[tuple[T, asyncio.Future[R]]] = []
        self.running: asyncio.Task | None = None

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self.queue.append((item, future))
        if self.running is None:
            self.running = asyncio.create_task(self._drain())
        return await future

    def _take(self) -> list[tuple[T, asyncio.Future[R]]]:
        taken, total = [], 0
        while self.queue and (not taken or total + self.size(self.queue[0][0]) <= self.max_items):
            item, future = self.queue.pop(0)
            if not future.done():  # its caller was cancelled
                taken.append((item, future))
                total += self.size(item)
        return taken

    async def _drain(self) -> None:
        try:
            while batch := self._take():
                try:
                    results = await self.flush([item for item, _ in batch])
                    if len(results) != len(batch):
                        raise RuntimeError(f"Batcher: flush returned {len(results)} results for {len(batch)} items")
                except asyncio.CancelledError:
                    for _, future in batch:
                        future.cancel()
                    raise
                except Exception as err:  # noqa: BLE001 - handed to every caller of the batch
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(err)
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            self.running = None
            for _, future in self.queue:  # only when cancelled: nothing will flush them
                if not future.done():
                    future.cancel()
            self.queue.clear()
