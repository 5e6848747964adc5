"""Engines a killed manager left running: the pool has the launcher stop them and removes their URLs from the router
before it starts any engine of its own (in-memory fakes of test_rollout_pool)."""

from __future__ import annotations

from services.common.errors import Unavailable
from services.rollout.pool.launchers import LaunchedEngine
from tests.unit.test_rollout_pool import make_pool, run, serving, until

OLD = ["http://old-0", "http://old-1"]


def with_leftovers(launcher, router, fleet) -> list[str]:
    """The router lists two engines of an earlier manager; the launcher's record names them; returns the calls."""
    calls: list[str] = []
    for url in OLD:
        fleet.alive[url], fleet.versions[url] = True, "old"
        router.post_worker(url)

    def stop_leftovers() -> list[LaunchedEngine]:
        calls.append(f"stop_leftovers, router lists {sorted(router.workers)}")
        for url in OLD:
            fleet.alive[url] = False
        return [LaunchedEngine(f"engine-{i}", url, 500 + i, alive=False) for i, url in enumerate(OLD)]

    launcher.stop_leftovers = stop_leftovers
    scale = launcher.scale

    def scale_after(replicas, remove=()):
        calls.append(f"scale {replicas}, router lists {sorted(router.workers)}")
        scale(replicas, remove)
    launcher.scale = scale_after
    return calls


def test_leftovers_are_stopped_and_deregistered_before_the_first_engine_starts():
    async def main():
        pool, launcher, router, fleet = make_pool(1)
        calls = with_leftovers(launcher, router, fleet)
        await pool.start()
        assert calls[:2] == [f"stop_leftovers, router lists {OLD}", "scale 1, router lists []"]
        assert sorted(router.workers) == ["http://engine-0"] and serving(pool) == 1
        stops = [e.detail for e in pool.status().events if e.kind == "stop"]
        assert stops == [f"engine-{i} {url} (pid {500 + i}), left by an earlier manager" for i, url in enumerate(OLD)]
        await pool.close()
    run(main())


def test_a_router_down_at_start_gets_the_leftovers_removed_by_the_controller_later():
    async def main():
        pool, launcher, router, fleet = make_pool(1)
        with_leftovers(launcher, router, fleet)
        list_workers, failures = router.list_workers, [2]

        def flaky() -> list[dict]:
            if failures[0]:
                failures[0] -= 1
                raise Unavailable("router http://router: down")
            return list_workers()
        router.list_workers = flaky
        await pool.start()
        await until(lambda: sorted(router.workers) == ["http://engine-0"], what="only the new engine listed")
        assert failures == [0] and serving(pool) == 1
        await pool.close()
    run(main())
