"""The engine pool's controller against in-memory fakes of the launcher, the router and the engines: scaling, joining
only with the current weights (disk or sync), draining, replacing dead or hung engines, weight-sync bookkeeping."""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import time

import pytest

from services.common.errors import InvalidArgument, Unavailable
from services.rollout.client import EngineState
from services.rollout.pool.config import PoolConfig
from services.rollout.pool.launchers import LaunchedEngine
from services.rollout.pool.pool import EnginePool

FAST = dict(tick_s=0.01, launcher_poll_s=0.0, health_check_interval_s=0.05, health_check_timeout_s=0.2,
            start_timeout_s=2.0, drain_timeout_s=1.0)


class FakeLauncher:
    def __init__(self, engines: FakeEngines) -> None:
        self.fleet = engines
        self.running: dict[str, LaunchedEngine] = {}
        self.counter = itertools.count()
        self.calls: list[tuple[int, tuple[str, ...]]] = []

    def engines(self) -> list[LaunchedEngine]:
        return [LaunchedEngine(e.name, e.url, e.pid, self.fleet.alive.get(e.url, False))
                for e in self.running.values()]

    def scale(self, replicas: int, remove=()) -> None:
        self.calls.append((replicas, tuple(remove)))
        for name in remove:
            self.fleet.alive.pop(self.running.pop(name).url, None)
        while len(self.running) > replicas:
            name = list(self.running)[-1]
            self.fleet.alive.pop(self.running.pop(name).url, None)
        while len(self.running) < replicas:
            i = next(self.counter)
            url = f"http://engine-{i}"
            self.running[f"engine-{i}"] = LaunchedEngine(f"engine-{i}", url, 1000 + i)
            self.fleet.alive[url] = True
            self.fleet.versions[url] = "default"

    def close(self) -> None:
        self.scale(0)


class FakeRouter:
    url = "http://router"

    def __init__(self, engines: FakeEngines) -> None:
        self.fleet = engines
        self.workers: dict[str, dict] = {}
        self.ids = itertools.count()
        self.first_request_versions: dict[str, str] = {}  # url -> the version it held when it was registered

    def list_workers(self) -> list[dict]:
        return [dict(w) for w in self.workers.values()]

    def post_worker(self, url: str) -> None:
        if self.fleet.alive.get(url) and url not in self.workers:
            self.workers[url] = {"id": f"w{next(self.ids)}", "url": url, "is_healthy": True, "load": 0}
            self.first_request_versions.setdefault(url, self.fleet.versions[url])

    def delete_worker(self, worker_id: str) -> None:
        self.workers = {u: w for u, w in self.workers.items() if w["id"] != worker_id}


class FakeEngines:
    """AsyncSGLangClient's calls over a table of engines; `hung` ones never answer /health_generate."""

    def __init__(self) -> None:
        self.alive: dict[str, bool] = {}
        self.hung: set[str] = set()
        self.versions: dict[str, str] = {}
        self.disk_loads: list[tuple[str, str, str]] = []
        self.aborted: list[str] = []

    async def health(self, url: str, timeout_s: float = 5.0) -> bool:
        if url in self.hung:
            await asyncio.sleep(timeout_s)
            return False
        return self.alive.get(url, False)

    async def health_generate(self, url: str, timeout_s: float = 5.0) -> bool:
        return await self.health(url, timeout_s)

    async def weight_version(self, url: str, timeout_s: float | None = None) -> str:
        if not self.alive.get(url):
            raise Unavailable(f"{url} is down")
        return self.versions[url]

    async def update_weights_from_disk(self, url: str, model_path: str, weight_version=None, timeout_s=None) -> dict:
        if not self.alive.get(url):
            raise Unavailable(f"{url} is down")
        self.disk_loads.append((url, model_path, weight_version))
        self.versions[url] = weight_version
        return {"success": True}

    async def abort_request(self, url: str, rid: str = "", abort_all: bool = False, timeout_s=None) -> None:
        self.aborted.append(url)

    async def server_info(self, url: str, timeout_s=None) -> dict:
        return {"internal_states": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}

    async def close(self) -> None:
        pass


def make_pool(replicas: int = 1, **config) -> tuple[EnginePool, FakeLauncher, FakeRouter, FakeEngines]:
    fleet = FakeEngines()
    launcher, router = FakeLauncher(fleet), FakeRouter(fleet)
    pool = EnginePool(launcher, router, PoolConfig(replicas=replicas, snapshot_dir="/snapshots", **{**FAST, **config}),
                      engines=fleet)
    return pool, launcher, router, fleet


async def until(check, timeout_s: float = 30.0, what: str = "condition") -> None:  # generous: loaded CI
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not true after {timeout_s} s"
        await asyncio.sleep(0.01)


def states(pool: EnginePool) -> dict[str, str]:
    return {e.name: e.state.name for e in pool.status().engines}


def serving(pool: EnginePool) -> int:
    return pool.status().count(EngineState.SERVING)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_start_serves_the_initial_engines_and_scales_up_and_down_newest_first():
    async def main():
        pool, launcher, router, fleet = make_pool(2)
        await pool.start()
        assert states(pool) == {"engine-0": "SERVING", "engine-1": "SERVING"}
        assert sorted(router.workers) == ["http://engine-0", "http://engine-1"]
        pool.scale(4)
        await until(lambda: serving(pool) == 4, what="4 serving")
        assert launcher.calls[:2] == [(2, ()), (4, ())]
        pool.scale(1)
        await until(lambda: len(pool.status().engines) == 1, what="scaled down to 1")
        assert states(pool) == {"engine-0": "SERVING"} and list(router.workers) == ["http://engine-0"]
        assert sorted(fleet.aborted) == ["http://engine-1", "http://engine-2", "http://engine-3"]  # drained
        # an engine leaves the status before its launcher call returns: on a loaded machine the stop lands later
        await until(lambda: sorted(r for r, removed in launcher.calls if removed) == [1, 2, 3],
                    what="engines 1-3 stopped by the launcher")
        assert [e.kind for e in pool.status().events].count("drain") == 3
        await pool.close()
        assert launcher.running == {} and router.workers == {}
    run(main())


def test_a_new_engine_loads_the_current_snapshot_before_the_router_lists_it():
    async def main():
        pool, launcher, router, fleet = make_pool(1)
        await pool.start()
        plan = await pool.begin_weight_sync("7")
        assert plan.engine_urls == ["http://engine-0"] and plan.snapshot_dir == "/snapshots"
        fleet.versions["http://engine-0"] = "7"  # what the broadcast does
        pool.end_weight_sync("7", success=True, engine_urls=plan.engine_urls, snapshot_path="/snapshots/weight_v7",
                             seconds=0.5, num_bytes=1000)
        pool.scale(3)
        await until(lambda: serving(pool) == 3, what="3 serving")
        assert router.first_request_versions == {"http://engine-0": "default",  # before the trainer's first sync
                                                 "http://engine-1": "7", "http://engine-2": "7"}
        assert sorted(fleet.disk_loads) == [(f"http://engine-{i}", "/snapshots/weight_v7", "7") for i in (1, 2)]
        assert {e.weight_version for e in pool.status().engines} == {"7"}
        metrics = pool.metrics.exposition().decode()
        assert 'physarum_rollout_engine_join_seconds_count{mode="disk"} 2.0' in metrics
        assert "physarum_rollout_weight_sync_bytes_total 1000.0" in metrics
        await pool.close()
    run(main())


def test_in_sync_mode_a_new_engine_waits_for_the_next_broadcast():
    async def main():
        pool, launcher, router, fleet = make_pool(1, join_mode="sync")
        await pool.start()
        plan = await pool.begin_weight_sync("1")
        assert plan.snapshot_dir == ""
        pool.end_weight_sync("1", success=True, engine_urls=plan.engine_urls)
        pool.scale(2)
        await until(lambda: states(pool).get("engine-1") == "JOINING", what="engine-1 joining")
        await asyncio.sleep(0.2)
        assert "http://engine-1" not in router.workers and fleet.disk_loads == []
        plan = await pool.begin_weight_sync("2")
        assert sorted(plan.engine_urls) == ["http://engine-0", "http://engine-1"]
        await asyncio.sleep(0.1)
        assert "http://engine-1" not in router.workers  # not before the broadcast ended
        for url in plan.engine_urls:
            fleet.versions[url] = "2"
        pool.end_weight_sync("2", success=True, engine_urls=plan.engine_urls)
        await until(lambda: serving(pool) == 2, what="engine-1 serving")
        assert router.first_request_versions["http://engine-1"] == "2"
        await pool.close()
    run(main())


def test_an_adapter_sync_no_engine_took_leaves_the_adapters_version_unknown():
    """A LoRA job's sync that reached no engine (none serving yet, as just after the manager restarted) must not
    record the adapter's version: the engines still hold an older adapter, and requests made at the recorded version
    would be generated with it."""
    async def main():
        pool, launcher, router, fleet = make_pool(1)
        await pool.start()
        plan = await pool.begin_weight_sync("2", lora_name="job-a")
        pool.end_weight_sync("2", success=True, engine_urls=plan.engine_urls, lora_name="job-a")
        assert pool.adapter_version("job-a") == "2"
        await pool.begin_weight_sync("3", lora_name="job-a")
        pool.end_weight_sync("3", success=True, engine_urls=[], lora_name="job-a")
        assert pool.adapter_version("job-a") == "2" and pool.status().adapter_versions == {"job-a": "2"}
        await pool.close()
    run(main())


def test_a_dead_engine_is_deregistered_and_replaced_and_rejoins_with_the_current_weights():
    async def main():
        pool, launcher, router, fleet = make_pool(2)
        await pool.start()
        plan = await pool.begin_weight_sync("3")
        for url in plan.engine_urls:
            fleet.versions[url] = "3"
        pool.end_weight_sync("3", success=True, engine_urls=plan.engine_urls, snapshot_path="/s/weight_v3")
        fleet.alive["http://engine-1"] = False  # SIGKILL
        await until(lambda: "engine-2" in states(pool) and serving(pool) == 2, what="engine-1 replaced")
        assert "engine-1" not in states(pool) and "http://engine-1" not in router.workers
        assert router.first_request_versions["http://engine-2"] == "3"
        assert ("engine-1",) in [removed for _, removed in launcher.calls]
        assert [e.engine for e in pool.status().events if e.kind == "fail"] == ["engine-1"]
        await pool.close()
    run(main())


def test_a_hung_engine_fails_its_health_check_and_is_replaced():
    async def main():
        pool, launcher, router, fleet = make_pool(1)
        await pool.start()
        fleet.hung.add("http://engine-0")
        start = time.monotonic()
        await until(lambda: "engine-0" not in states(pool), what="engine-0 failed")
        assert time.monotonic() - start < 1.0  # interval 0.05 + timeout 0.2
        await until(lambda: serving(pool) == 1, what="replacement serving")
        assert states(pool) == {"engine-1": "SERVING"} and list(router.workers) == ["http://engine-1"]
        assert 'physarum_rollout_health_checks_total{result="failed"} 1.0' in pool.metrics.exposition().decode()
        await pool.close()
    run(main())


def test_a_failed_sync_takes_every_engine_out_until_it_holds_the_new_version():
    async def main():
        pool, launcher, router, fleet = make_pool(2)
        await pool.start()
        plan = await pool.begin_weight_sync("4")
        fleet.alive["http://engine-1"] = False  # died mid-broadcast; engine-0 got part of the weights
        pool.end_weight_sync("4", success=False, engine_urls=plan.engine_urls, failed_urls=["http://engine-1"],
                             snapshot_path="/s/weight_v4", error="peer died")
        retry = await pool.begin_weight_sync("4")  # waits for the check of engine-1
        assert retry.engine_urls in ([], ["http://engine-0"])
        assert "http://engine-1" not in router.workers
        pool.end_weight_sync("4", success=True, engine_urls=retry.engine_urls, snapshot_path="/s/weight_v4")
        await until(lambda: serving(pool) == 2 and "engine-1" not in states(pool), what="both serving version 4")
        assert {e.weight_version for e in pool.status().engines} == {"4"}
        assert router.first_request_versions.get("http://engine-2") == "4"
        await pool.close()
    run(main())


def test_health_checks_pause_while_a_weight_sync_runs():
    async def main():
        pool, launcher, router, fleet = make_pool(1)
        await pool.start()
        await pool.begin_weight_sync("5")
        fleet.hung.add("http://engine-0")  # a paused engine may answer slowly
        await asyncio.sleep(0.5)
        assert states(pool) == {"engine-0": "SERVING"} and pool.status().weight_sync_in_progress
        fleet.hung.discard("http://engine-0")
        fleet.versions["http://engine-0"] = "5"
        pool.end_weight_sync("5", success=True, engine_urls=["http://engine-0"])
        await asyncio.sleep(0.2)
        assert states(pool) == {"engine-0": "SERVING"} and not pool.status().weight_sync_in_progress
        await pool.close()
    run(main())


def test_engines_that_never_start_fail_the_pool_start():
    async def main():
        pool, launcher, router, fleet = make_pool(1, start_timeout_s=0.05, max_start_failures=2)
        original = launcher.scale

        def scale_dead(replicas, remove=()):
            original(replicas, remove)
            for e in launcher.running.values():
                fleet.alive[e.url] = False
        launcher.scale = scale_dead
        with pytest.raises(Unavailable, match="2 engines failed to start"):
            await pool.start()
        await pool.close()
    run(main())


def test_scale_checks_its_argument_and_external_engines_need_no_launcher():
    async def main():
        fleet = FakeEngines()
        fleet.alive["http://ext"], fleet.versions["http://ext"] = True, "default"
        router = FakeRouter(fleet)
        pool = EnginePool(None, router, PoolConfig(**FAST), external_urls=["http://ext/"], engines=fleet)
        await pool.start()
        assert [(e.name, e.url, e.state, e.external) for e in pool.status().engines] == [
            ("external-0", "http://ext", EngineState.SERVING, True)]
        with pytest.raises(InvalidArgument, match="no launcher"):
            pool.scale(1)
        with pytest.raises(InvalidArgument, match="replicas must be >= 0"):
            pool.scale(-1)
        await pool.close()
        assert list(router.workers) == ["http://ext"]  # external engines stay registered
    run(main())


def newest(pool: EnginePool):
    """The most recently launched engine the pool knows (None between a hand-back and the next launch)."""
    return max(pool.records.values(), key=lambda e: int(e.name.split("-")[1]), default=None)


def healthy_replacement_of(pool: EnginePool, victim: str):
    """The engine launched after `victim`, once it answers /health (else None)."""
    e = newest(pool)
    return e if e is not None and e.name != victim and e.healthy else None


def test_engines_killed_after_they_showed_they_start_are_replaced_at_once_however_often():
    """Repeated kills (a node lost, chaos): each replacement answers /health and, in sync mode with no broadcast
    since, waits in JOINING; killed there after healthy_proof_s, it is replaced with no wait. The start-failure
    back-off (which only counted serving as proof) made this 1, 2, 4, 8, 16 s."""
    async def main():
        pool, launcher, router, fleet = make_pool(1, join_mode="sync", healthy_proof_s=0.05)
        await pool.start()
        plan = await pool.begin_weight_sync("1")  # the version no replacement holds until the next broadcast
        pool.end_weight_sync("1", success=True, engine_urls=plan.engine_urls)
        for kill in range(6):
            victim = newest(pool)
            fleet.alive[victim.url] = False  # SIGKILL
            await until(functools.partial(healthy_replacement_of, pool, victim.name),
                        what=f"replacement {kill + 1} answering /health")
            replacement = newest(pool)
            assert replacement.state == EngineState.JOINING
            await until(functools.partial(getattr, replacement, "proven"),
                        what=f"replacement {kill + 1} healthy for healthy_proof_s")
        assert pool.replacements == collections.deque(
            [(f"engine-{i}", 0, 0.0) for i in range(6)])  # engine-0 served; engines 1-5 were healthy long enough
        assert pool.start_failures == 0
        await pool.close()
    run(main())


def test_a_crash_loop_before_health_backs_off_doubling_until_an_engine_shows_it_starts():
    """Replacements that die before they answer /health double the wait (start_backoff_s, 2x, 4x); one that stays
    healthy healthy_proof_s (without serving) resets the count, and the next early death waits the shortest again."""
    async def main():
        pool, launcher, router, fleet = make_pool(1, join_mode="sync", healthy_proof_s=0.2, start_backoff_s=0.01)
        await pool.start()
        plan = await pool.begin_weight_sync("1")
        pool.end_weight_sync("1", success=True, engine_urls=plan.engine_urls)
        original, crashes = launcher.scale, {"left": 3}

        def scale_then_crash(replicas, remove=()):  # the next replacements die before they answer /health
            original(replicas, remove)
            for e in launcher.running.values():
                if crashes["left"] and e.name != "engine-0" and fleet.alive.get(e.url) and e.url not in router.workers:
                    fleet.alive[e.url] = False
                    crashes["left"] -= 1
        launcher.scale = scale_then_crash
        fleet.alive["http://engine-0"] = False  # the serving engine is killed
        await until(lambda: crashes["left"] == 0 and healthy_replacement_of(pool, "engine-3") is not None,
                    what="engine-4, after three crashes, answering /health")
        assert newest(pool).name == "engine-4"
        assert [delay for _, _, delay in pool.replacements] == [0.0, 0.01, 0.02, 0.04]
        assert pool.start_failures == 3
        await until(lambda: pool.start_failures == 0, what="engine-4 healthy for healthy_proof_s")
        assert states(pool)["engine-4"] == "JOINING"  # it never served: being healthy long enough was the proof
        crashes["left"] = 1
        fleet.alive["http://engine-4"] = False
        await until(lambda: len(pool.replacements) == 6, what="engine-4 and engine-5 replaced")
        assert list(pool.replacements)[4:] == [("engine-4", 0, 0.0), ("engine-5", 1, 0.01)]
        await pool.close()
    run(main())
