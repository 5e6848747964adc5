"""The pool owns the router's worker list: a worker it never registered is removed at the next refresh."""

from __future__ import annotations

import asyncio

from services.rollout.pool.registrations import Registrations


class FakeRouter:
    def __init__(self, workers: list[dict]) -> None:
        self.workers, self.deleted = workers, []

    def list_workers(self) -> list[dict]:
        return list(self.workers)

    def delete_worker(self, worker_id: str) -> None:
        self.deleted.append(worker_id)

    def post_worker(self, url: str) -> None:
        self.workers.append({"id": str(len(self.workers) + 1), "url": url, "is_healthy": True})


async def _blocking(fn, *args):
    return fn(*args)


def test_foreign_workers_are_removed_and_the_pools_own_kept():
    router = FakeRouter([{"id": "1", "url": "http://10.6.6.6:30000", "is_healthy": True}])
    registrations = Registrations(router, _blocking, poll_s=0.01, own_router=True)

    async def scenario() -> None:
        await registrations.register("http://127.0.0.1:31001")   # this pool's engine: POST, not yet listed
        await registrations.refresh({"http://127.0.0.1:31001"})
    asyncio.run(scenario())
    assert router.deleted == ["1"]  # the foreign worker; the pool's own stays
    assert registrations.listed("http://127.0.0.1:31001")
