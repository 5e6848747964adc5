"""The engine pool, one owner: keeps the desired number of engines through a launcher, admits an engine to the router
only once it holds the trainer's current weights, drains engines that leave and replaces dead or hung ones.

A controller task on the manager's event loop reconciles, tick by tick, what the launcher and the router report with
what is wanted, and runs one step at a time on each engine (engine_steps.py). It knows nothing of prompts or samples:
requests that a leaving engine aborts are retried by the manager on other engines.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import time

from services.common.errors import InvalidArgument, PhysarumError, Unavailable
from services.common.sglang import AsyncSGLangClient
from services.rollout.client import EngineInfo, EngineState, EngineStatus, PoolStatus, ScaleEvent, WeightSyncPlan
from services.rollout.pool import engine_steps as steps
from services.rollout.pool.config import PoolConfig
from services.rollout.pool.engine_steps import EngineRecord
from services.rollout.pool.launchers import EngineLauncher
from services.rollout.pool.metrics import PoolMetrics
from services.rollout.pool.registrations import Registrations
from services.rollout.pool.router import RouterClient

log = logging.getLogger(__name__)

MAX_EVENTS = 200


class EnginePool:
    """Engines from `launcher` (None: only `external_urls`) behind `router`. Call start() inside the event loop."""

    def __init__(self, launcher: EngineLauncher | None, router: RouterClient, config: PoolConfig, *,
                 external_urls: list[str] = (), engines: AsyncSGLangClient | None = None) -> None:
        if config.replicas and launcher is None:
            raise InvalidArgument(f"{config.replicas} engines wanted but the pool has no launcher")
        self.launcher = launcher
        self.router = router
        self.config = config
        self.desired = config.replicas
        self.launcher_replicas = 0  # what the launcher was last asked for
        self.records: dict[str, EngineRecord] = {
            f"external-{i}": EngineRecord(f"external-{i}", url.rstrip("/"), external=True)
            for i, url in enumerate(external_urls)}
        self.removing: set[str] = set()  # names handed back to the launcher: ignored by the poll meanwhile
        self.registrations = Registrations(router, self._blocking, config.tick_s, own_router=config.own_router)
        self.rest_url = ""
        self.last_error = ""
        self.weight_version: str | None = None  # the trainer's current version (None before its first sync)
        self.settled_version: str | None = None  # the last version every serving engine holds (not mid-sync)
        # each LoRA adapter's last version the engines took (the jobs sharing the pool each count their own)
        self.adapter_versions: dict[str, str] = {}
        self.adapter_snapshots: dict[str, str] = {}  # each adapter's snapshot at that version (what joiners load)
        self.snapshot_path = ""
        self.sync_started_s: float | None = None
        self.events: collections.deque[ScaleEvent] = collections.deque(maxlen=MAX_EVENTS)
        self.metrics = PoolMetrics()
        self.engines = engines or AsyncSGLangClient(timeout_s=config.health_check_timeout_s)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-pool")
        self.launcher_lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.ready = asyncio.Event()  # set once every engine wanted at start serves
        self.start_failures = 0  # launched engines in a row that died before they showed that engines start
        self.replacements: collections.deque[tuple[str, int, float]] = collections.deque(maxlen=MAX_EVENTS)
        self.last_poll_s = float("-inf")
        self.controller: asyncio.Task | None = None
        self.fatal: Exception | None = None
        self.closing = False

    # -- the API ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Run the controller; returns once the initial engines serve, raises if they cannot start."""
        self.event("scale", detail=f"start: {self.desired} engines" +
                    (f" + {len(self.records)} external" if self.records else ""))
        self.metrics.desired.set(self.desired)
        await self._remove_leftovers()
        self.controller = asyncio.create_task(self._control(), name="engine-pool")
        ready = asyncio.create_task(self.ready.wait())
        await asyncio.wait({self.controller, ready}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            self.controller.result()

    def scale(self, replicas: int) -> PoolStatus:
        """Set the desired number of launched engines; the controller gets there in the background."""
        if replicas < 0:
            raise InvalidArgument(f"replicas must be >= 0, got {replicas}")
        if replicas and self.launcher is None:
            raise InvalidArgument("this pool has no launcher (only --engine-urls): it cannot start engines")
        if replicas != self.desired:
            self.event("scale", detail=f"{self.desired} -> {replicas} engines")
            self.desired = replicas
            self.metrics.desired.set(replicas)
            self.wake.set()
        return self.status()

    @property
    def takes_engine_options(self) -> bool:
        """Whether a job's engine options can reach every engine: the launcher starts them with options, and no
        external engine (launched by someone else) serves beside them."""
        return bool(getattr(self.launcher, "takes_options", False)) and not any(e.external for e in
                                                                               self.records.values())

    async def relaunch(self, options: dict, reason: str) -> None:
        """Have the launcher start engines with these server options from now on, and replace the running ones
        (a launcher that replaces them itself, like a Deployment's rolling update, is left to it)."""
        self.event("relaunch", detail=reason)
        if await self._launcher_call(self.launcher.set_engine_options, options):
            return
        for e in [e for e in self.records.values() if not e.external]:
            self._start_task(e, steps.fail(self, e, "relaunched with a job's engine options"))

    def status(self) -> PoolStatus:
        engines = [EngineStatus(name=e.name, url=e.url, state=e.state, pid=e.pid, weight_version=e.weight_version or "",
                                healthy=e.healthy, load=self.registrations.load(e.url), external=e.external)
                   for e in self.records.values()]
        return PoolStatus(desired_replicas=self.desired, engines=engines, weight_version=self.weight_version or "",
                          join_mode=self.config.join_mode, snapshot_dir=self.snapshot_dir, router_url=self.router.url,
                          rest_url=self.rest_url, events=list(self.events), weight_sync_in_progress=self.syncing,
                          adapter_versions=dict(self.adapter_versions))

    async def engine_infos(self) -> list[EngineInfo]:
        """The engines a weight sync may include (joining or serving), with the version each reports now."""
        listed = [e for e in self.records.values() if e.state in (EngineState.JOINING, EngineState.SERVING)]

        async def info(e: EngineRecord) -> EngineInfo:
            try:
                version = await self.engines.weight_version(e.url, timeout_s=5.0)
            except PhysarumError:
                version = ""
            return EngineInfo(url=e.url, weight_version=version, healthy=e.healthy)
        return list(await asyncio.gather(*(info(e) for e in listed)))

    @property
    def snapshot_dir(self) -> str:
        return self.config.snapshot_dir if self.config.join_mode == "disk" else ""

    @property
    def syncing(self) -> bool:
        return self.sync_started_s is not None

    def adapter_version(self, lora_name: str) -> str | None:
        """The last version of LoRA adapter `lora_name` the engines took (None: none yet)."""
        return self.adapter_versions.get(lora_name)

    async def begin_weight_sync(self, version: str, lora_name: str = "") -> WeightSyncPlan:
        """The trainer starts broadcasting `version` (of adapter `lora_name`, when set): it becomes current; health
        checks pause until the end.

        Engines a failed sync named are checked first (briefly), so that a retry leaves out the dead ones.
        """
        checks = [e.task for e in self.records.values() if e.suspect and e.busy]
        if checks:
            await asyncio.wait(checks, timeout=steps.SUSPECT_CHECK_S + 1.0)
        self.weight_version, self.snapshot_path, self.sync_started_s = version, "", time.monotonic()
        members = [e.url for e in self.records.values() if e.healthy and not e.suspect and (
            e.state == EngineState.SERVING or (e.state == EngineState.JOINING and not e.disk_loading))]
        log.info("weight sync of version %s%s begins with %d engines", version,
                 f" of adapter {lora_name}" if lora_name else "", len(members))
        return WeightSyncPlan(engine_urls=members, snapshot_dir=self.snapshot_dir)

    def end_weight_sync(self, version: str, *, success: bool, engine_urls: list[str], failed_urls: list[str] = (),
                        snapshot_path: str = "", seconds: float = 0.0, num_bytes: int = 0, error: str = "",
                        lora_name: str = "") -> None:
        """The broadcast ended: members that took it now hold `version` (adapter `lora_name` at that version,
        when set); failed ones are checked at once.

        After a failure every engine still holds an older (or a partial) version, so none serves until it loads the
        snapshot (disk join) or takes the trainer's next broadcast.
        """
        self.metrics.weight_syncs.labels("ok" if success else "failed").inc()
        if version != self.weight_version:
            log.warning("weight sync of version %s ended, but version %s began since", version, self.weight_version)
            return
        self.sync_started_s = None
        if snapshot_path:
            self.snapshot_path = snapshot_path
        by_url = {e.url: e for e in self.records.values()}
        if success:
            self.metrics.weight_sync_seconds.observe(seconds)
            self.metrics.weight_sync_bytes.inc(num_bytes)
            took = [e for url in engine_urls if (e := by_url.get(url.rstrip("/"))) is not None]
            for e in took:
                e.weight_version = version
                if e.state == EngineState.JOINING:
                    e.join_mode = "sync"
            if took:
                self.settled_version = version
            # an adapter's version is the engines': a sync no engine took (none serving yet, as just after a restart)
            # leaves it unknown, so the job's requests wait for its announce instead of using the engines' older one
            if lora_name and took:
                self.adapter_versions[lora_name] = version
                if snapshot_path:
                    self.adapter_snapshots[lora_name] = snapshot_path
            log.info("weight sync of version %s: %d engines in %.2f s, %.1f MB", version, len(engine_urls), seconds,
                     num_bytes / 1e6)
        else:
            log.warning("weight sync of version %s failed (%s); checking %s", version, error, failed_urls)
            for url in failed_urls:
                e = by_url.get(url.rstrip("/"))
                if e is not None and e.state in (EngineState.JOINING, EngineState.SERVING):
                    e.suspect = True
                    self._start_task(e, steps.check_suspect(self, e))
        self.wake.set()

    async def close(self) -> None:
        """Stop the controller, deregister the launched engines and stop them."""
        self.closing = True
        tasks = [t for t in [self.controller, *(e.task for e in self.records.values())] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self.registrations.deregister_all({e.url for e in self.records.values() if not e.external})
        except PhysarumError as err:
            log.warning("engine pool: could not deregister its engines: %s", err)
        if self.launcher is not None:
            await self._launcher_call(self.launcher.close)
        self.executor.shutdown(wait=False)
        await self.engines.close()

    async def _remove_leftovers(self) -> None:
        """Stop the engines a killed manager left running (same launcher work dir) and remove them from the router
        before any engine starts: nothing would ever update their weights again."""
        stop_leftovers = getattr(self.launcher, "stop_leftovers", None)  # only where engines can outlive a manager
        if stop_leftovers is None:
            return
        leftovers = await self._launcher_call(stop_leftovers)
        if not leftovers:
            return
        for e in leftovers:
            self.event("stop", detail=f"{e.name} {e.url} (pid {e.pid}), left by an earlier manager")
        urls = {e.url.rstrip("/") for e in leftovers}
        self.registrations.inherit(urls)  # should the router not answer now, the controller's refreshes remove them
        try:
            await self.registrations.deregister_all(urls)
        except PhysarumError as err:
            log.warning("engine pool: could not remove engines left by an earlier manager from the router yet: %s",
                        err)

    # -- the controller ----------------------------------------------------------------------------------------

    async def _blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    async def _launcher_call(self, fn, *args):
        async with self.launcher_lock:
            return await self._blocking(fn, *args)

    def event(self, kind: str, engine: str = "", detail: str = "") -> None:
        self.events.append(ScaleEvent(time_s=time.time(), kind=kind, engine=engine, detail=detail))
        self.metrics.scale_events.labels(kind).inc()
        log.info("engine pool: %s %s %s", kind, engine, detail)

    def _start_task(self, e: EngineRecord, coro) -> None:
        if e.busy:
            e.task.cancel()
        e.task = asyncio.create_task(coro, name=f"{e.name}")

    async def _control(self) -> None:
        while not self.closing:
            try:
                await self._tick()
                self.last_error = ""
            except PhysarumError as err:
                if str(err) != self.last_error:  # once per distinct error, not every tick
                    log.warning("engine pool: %s", err)
                self.last_error = str(err)
            except Exception:  # noqa: BLE001 - the controller must keep going
                log.exception("engine pool: tick failed")
            if self.fatal is not None:
                raise self.fatal
            try:
                await asyncio.wait_for(self.wake.wait(), self.config.tick_s)
            except TimeoutError:
                pass
            self.wake.clear()

    async def _tick(self) -> None:
        now = time.monotonic()
        if self.syncing and now - self.sync_started_s > self.config.weight_sync_max_s:
            log.warning("weight sync of version %s never ended; health checks resume", self.weight_version)
            self.sync_started_s = None
        if self.launcher is not None and now - self.last_poll_s >= self.config.launcher_poll_s:
            await self._poll_launcher()
        await self.registrations.refresh({e.url for e in self.records.values()})
        await self._resize()
        for e in list(self.records.values()):
            if not e.external and e.state != EngineState.FAILED and e.healthy_for(self.config.healthy_proof_s):
                self.engine_proven(e)
            if not e.busy:
                self._dispatch(e, time.monotonic())
        self.update_gauges()
        serving = [e for e in self.records.values() if e.state == EngineState.SERVING]
        if not self.ready.is_set() and sum(not e.external for e in serving) >= self.desired and all(
                e.state == EngineState.SERVING for e in self.records.values() if e.external):
            self.ready.set()

    async def _poll_launcher(self) -> None:
        launched = await self._launcher_call(self.launcher.engines)
        self.last_poll_s = time.monotonic()
        seen = set()
        for item in launched:
            if item.name in self.removing:
                continue
            seen.add(item.name)
            e = self.records.get(item.name)
            if e is None:
                e = self.records[item.name] = EngineRecord(item.name, item.url.rstrip("/"), pid=item.pid)
                self.event("launch", e.name, f"{e.url}" + (f" pid {e.pid}" if e.pid else ""))
            if not item.alive and e.state not in (EngineState.FAILED, EngineState.DRAINING):
                self._start_task(e, steps.fail(self, e, "its process exited"))
        for e in list(self.records.values()):
            if not e.external and e.name not in seen and e.state not in (EngineState.FAILED, EngineState.DRAINING):
                self._start_task(e, steps.fail(self, e, "the launcher no longer lists it"))

    async def _resize(self) -> None:
        if self.launcher is None:
            return
        leaving = sum(not e.external and e.state == EngineState.DRAINING for e in self.records.values())
        effective = self.launcher_replicas - leaving
        if effective < self.desired:
            self.launcher_replicas += self.desired - effective
            await self._launcher_call(self.launcher.scale, self.launcher_replicas, ())
            self.last_poll_s = float("-inf")
        elif effective > self.desired:
            order = {EngineState.STARTING: 0, EngineState.JOINING: 1, EngineState.SERVING: 2}
            candidates = sorted((e for e in self.records.values() if not e.external and e.state in order),
                                key=lambda e: (order[e.state], -e.created_s))
            victims = candidates[: effective - self.desired]
            for e in victims:
                e.state = EngineState.DRAINING
                self._start_task(e, steps.drain(self, e))
            unseen = effective - self.desired - len(victims)  # launched but not listed yet: nothing to drain
            if unseen > 0:
                self.launcher_replicas -= unseen
                await self._launcher_call(self.launcher.scale, self.launcher_replicas, ())

    def _dispatch(self, e: EngineRecord, now: float) -> None:
        if e.state == EngineState.STARTING:
            if not e.external and now - e.created_s > self.config.start_timeout_s:
                reason = f"no /health reply {self.config.start_timeout_s:.0f} s after launch"
                self._start_task(e, steps.fail(self, e, reason))
            else:
                self._start_task(e, steps.probe_started(self, e))
        elif e.state == EngineState.JOINING and now >= e.next_check_s:
            self._start_task(e, steps.join(self, e))
        elif e.state == EngineState.SERVING and not self.syncing:
            if self.weight_version is not None and e.weight_version != self.weight_version:
                self._start_task(e, steps.demote(self, e, f"it holds version {e.weight_version}, the trainer's is "
                                                    f"{self.weight_version}", weights_ok=False))
            elif not self.registrations.listed(e.url):
                self._start_task(e, steps.demote(self, e, "the router no longer lists it", weights_ok=True))
            elif now >= e.next_check_s:
                self._start_task(e, steps.health_check(self, e))

    def update_gauges(self) -> None:
        """Engines by state, per-engine load and health, as of now (also before each /metrics scrape)."""
        for state in EngineState:
            self.metrics.engines.labels(state.name.lower()).set(sum(e.state == state for e in self.records.values()))
        for e in self.records.values():
            self.metrics.load.labels(e.name).set(self.registrations.load(e.url))
            self.metrics.healthy.labels(e.name).set(int(e.healthy))

    # What the engine steps ask of the pool (engine_steps.StepHost): they change its state only through these.

    def engine_proven(self, e: EngineRecord) -> None:
        """`e` showed that engines start (it serves, or was healthy healthy_proof_s): forget the start failures."""
        if not e.proven:
            e.proven = True
            self.start_failures = 0

    def replacement_delay(self, e: EngineRecord, reason: str) -> float | None:
        """The wait before replacing `e`, a launched engine that failed (None: the pool gives up, start() raises): none
        if it showed that engines start, else doubling with each start failure in a row (PoolConfig). Each decision
        is kept in `replacements` (engine, start failures in a row, seconds) and in the pool's events."""
        if e.proven or e.healthy_for(self.config.healthy_proof_s):
            self.engine_proven(e)
            delay_s = 0.0
        else:
            self.start_failures += 1
            if not self.ready.is_set() and self.start_failures >= self.config.max_start_failures:
                self.fatal = Unavailable(f"engine pool: {self.start_failures} engines failed to start; last: "
                                         f"{e.name} {e.url}: {reason}")
                self.wake.set()
                return None
            doubled = self.config.start_backoff_s * 2.0 ** (self.start_failures - 1)
            delay_s = min(doubled, self.config.start_backoff_max_s)
        self.replacements.append((e.name, self.start_failures, delay_s))
        self.event("replace", e.name, f"in {delay_s:.2f} s ({self.start_failures} start failures in a row)")
        return delay_s

    async def replace(self, e: EngineRecord) -> None:
        """Stop `e` and have the launcher start another in its place."""
        await self._hand_back(e, self.launcher_replicas)

    async def retire(self, e: EngineRecord) -> None:
        """Stop `e` for good: the launcher runs one engine fewer."""
        await self._hand_back(e, self.launcher_replicas - 1)

    async def _hand_back(self, e: EngineRecord, replicas: int) -> None:
        """Forget `e` and have the launcher stop it, then run `replicas` engines."""
        self.records.pop(e.name, None)
        self.metrics.forget_engine(e.name)
        self.removing.add(e.name)
        self.launcher_replicas = replicas
        try:
            await self._launcher_call(self.launcher.scale, self.launcher_replicas, (e.name,))
        finally:
            self.removing.discard(e.name)
            self.last_poll_s = float("-inf")
            self.wake.set()
