"""What the pool does to one engine, one step at a time (one task per engine): bring a new engine to the trainer's
current weights and register it with the router, check a serving one, and take an engine out (demote it to rejoin,
fail and replace it, drain and stop it). When each step runs is the pool's decision (pool.py). A step reads
the pool through `StepHost` and changes the pool's state only by asking it; it does not import pool.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from services.common.errors import PhysarumError
from services.common.sglang import AsyncSGLangClient
from services.rollout.client import EngineState
from services.rollout.pool import adapter_join
from services.rollout.pool.config import PoolConfig
from services.rollout.pool.metrics import PoolMetrics
from services.rollout.pool.registrations import Registrations

log = logging.getLogger(__name__)

JOIN_PROBE_S = 1.0  # how often an engine waiting for weights is asked /health
SUSPECT_CHECK_S = 5.0  # /health timeout for an engine a failed weight sync named


@dataclass(eq=False)
class EngineRecord:
    """One engine as the pool sees it."""

    name: str
    url: str
    pid: int = 0
    external: bool = False
    state: EngineState = EngineState.STARTING
    created_s: float = field(default_factory=time.monotonic)
    healthy_s: float = 0.0  # when it first answered /health: its join time starts
    weight_version: str | None = None  # the version it holds in full, as far as the pool knows
    join_mode: str = "none"  # how it got the weights it joined with: disk, sync, or none (no version yet)
    healthy: bool = False
    served: bool = False  # it was SERVING once
    proven: bool = False  # it showed that engines start (served, or healthy for the pool's healthy_proof_s)
    next_check_s: float = 0.0
    disk_loading: bool = False
    suspect: bool = False  # a failed weight sync named it: left out of syncs until it is checked
    task: asyncio.Task | None = None

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def healthy_for(self, seconds: float) -> bool:
        """It first answered /health at least `seconds` ago."""
        return self.healthy_s > 0 and time.monotonic() - self.healthy_s >= seconds


class StepHost(Protocol):
    """The pool as a step sees it (EnginePool implements it)."""

    config: PoolConfig
    engines: AsyncSGLangClient
    registrations: Registrations
    metrics: PoolMetrics
    wake: asyncio.Event  # set: the controller reconsiders at once
    weight_version: str | None  # the trainer's current version
    settled_version: str | None  # the last version every serving engine holds
    snapshot_path: str  # the latest snapshot of it on disk ("" if none yet)

    @property
    def syncing(self) -> bool: ...

    def event(self, kind: str, engine: str = "", detail: str = "") -> None: ...

    def engine_proven(self, e: EngineRecord) -> None: ...

    def replacement_delay(self, e: EngineRecord, reason: str) -> float | None: ...

    async def replace(self, e: EngineRecord) -> None: ...

    async def retire(self, e: EngineRecord) -> None: ...


async def probe_started(pool: StepHost, e: EngineRecord) -> None:
    """A launched engine: it joins once it answers /health."""
    if await pool.engines.health(e.url, timeout_s=min(5.0, pool.config.health_check_timeout_s)):
        e.state, e.healthy, e.healthy_s = EngineState.JOINING, True, time.monotonic()
        pool.wake.set()


async def join(pool: StepHost, e: EngineRecord) -> None:
    """Bring the engine to the current weights (or wait for the next sync), then register it with the router."""
    current = pool.weight_version
    if current is not None and e.weight_version != current:
        if pool.registrations.registered(e.url):  # it must take no request before it has the weights
            await pool.registrations.deregister(e.url)
        if pool.syncing or pool.config.join_mode != "disk" or not pool.snapshot_path:
            e.next_check_s = time.monotonic() + JOIN_PROBE_S  # the trainer's next broadcast includes it
            await check_alive(pool, e)
            return
        await load_snapshot(pool, e, current)
        if e.weight_version != current:
            await check_alive(pool, e)
            return
    e.next_check_s = 0.0
    if not pool.registrations.healthy(e.url):
        await pool.registrations.register(e.url)
        return
    e.state, e.served, e.healthy = EngineState.SERVING, True, True
    if e.weight_version is not None and e.weight_version == pool.weight_version and not pool.syncing:
        pool.settled_version = e.weight_version  # an engine that joined from the snapshot (or a restarted pool's)
    e.next_check_s = time.monotonic() + pool.config.health_check_first_wait_s + pool.config.health_check_interval_s
    pool.engine_proven(e)
    join_s = time.monotonic() - e.healthy_s
    pool.metrics.join_seconds.labels(e.join_mode).observe(join_s)
    pool.event("join", e.name, f"{e.url} serving weight version {e.weight_version} ({e.join_mode}) "
                               f"{join_s:.2f} s after it answered /health")


async def check_alive(pool: StepHost, e: EngineRecord) -> None:
    e.healthy = await pool.engines.health(e.url, timeout_s=min(5.0, pool.config.health_check_timeout_s))
    if not e.healthy:
        await fail(pool, e, "it stopped answering /health while joining")


async def load_snapshot(pool: StepHost, e: EngineRecord, version: str) -> None:
    path, start = pool.snapshot_path, time.monotonic()
    e.disk_loading = True
    try:
        adapters = adapter_join.pool_adapters(path, pool.adapter_snapshots.values())
        if adapters:  # LoRA jobs' snapshots: each one's adapter over the base model the engine started with
            await adapter_join.load_adapters(pool.engines, e.url, adapters, version, pool.config.disk_load_timeout_s)
        else:
            await pool.engines.update_weights_from_disk(e.url, path, version,
                                                        timeout_s=pool.config.disk_load_timeout_s)
    except PhysarumError as err:
        log.warning("engine %s: loading snapshot %s failed (retrying): %s", e.name, path, err)
        e.next_check_s = time.monotonic() + 2.0
        return
    finally:
        e.disk_loading = False
    if pool.weight_version == version and not pool.syncing:  # else superseded: a newer version began meanwhile
        e.weight_version, e.join_mode = version, "disk"
        log.info("engine %s loaded weight version %s from %s in %.2f s", e.name, version, path,
                 time.monotonic() - start)


async def health_check(pool: StepHost, e: EngineRecord) -> None:
    """A serving engine: /health_generate within the timeout, and still the weight version it joined with."""
    ok = await pool.engines.health_generate(e.url, timeout_s=pool.config.health_check_timeout_s)
    if pool.syncing or e.state != EngineState.SERVING:
        return  # a weight sync began meanwhile: its pause may explain a slow answer
    pool.metrics.health_checks.labels("ok" if ok else "failed").inc()
    if not ok:
        await fail(pool, e, f"no /health_generate reply in {pool.config.health_check_timeout_s} s")
        return
    e.healthy = True
    if e.weight_version is not None:
        try:
            reported = await pool.engines.weight_version(e.url, timeout_s=pool.config.health_check_timeout_s)
        except PhysarumError:
            reported = e.weight_version
        if reported != e.weight_version and not pool.syncing:
            await demote(pool, e, f"it reports weight version {reported}, not {e.weight_version} (restarted?)",
                         weights_ok=False)
            return
    e.next_check_s = time.monotonic() + pool.config.health_check_interval_s


async def check_suspect(pool: StepHost, e: EngineRecord) -> None:
    """Named by a failed weight sync: replaced if dead or hung; else it rejoins (its weights may be partial)."""
    try:
        if not await pool.engines.health(e.url, timeout_s=SUSPECT_CHECK_S):
            await fail(pool, e, f"it failed a weight sync and gave no /health reply in {SUSPECT_CHECK_S} s")
        elif e.state == EngineState.SERVING:
            await demote(pool, e, "it failed a weight sync", weights_ok=False)
    finally:
        e.suspect = False


async def demote(pool: StepHost, e: EngineRecord, reason: str, *, weights_ok: bool) -> None:
    """Out of the router, back to joining (with its weights, or to get the current ones first)."""
    pool.event("demote", e.name, reason)
    e.state = EngineState.JOINING
    if not weights_ok:
        e.weight_version = None
    e.next_check_s = 0.0
    await pool.registrations.deregister(e.url)


async def fail(pool: StepHost, e: EngineRecord, reason: str) -> None:
    """Deregister a dead or hung engine and have the launcher replace it (external engines are only re-probed)."""
    e.state, e.healthy = EngineState.FAILED, False
    pool.event("fail", e.name, f"{e.url}: {reason}")
    await pool.registrations.deregister(e.url)
    if e.external:
        e.state, e.weight_version, e.created_s = EngineState.STARTING, None, time.monotonic()
        return
    delay_s = pool.replacement_delay(e, reason)
    if delay_s is None:
        return
    if delay_s:
        await asyncio.sleep(delay_s)
    await pool.replace(e)


async def drain(pool: StepHost, e: EngineRecord) -> None:
    """Leave: no new requests (deregister), abort the running ones (the manager retries them elsewhere), stop."""
    pool.event("drain", e.name, e.url)
    await pool.registrations.deregister(e.url)
    deadline = time.monotonic() + pool.config.drain_timeout_s
    while time.monotonic() < deadline and e.healthy:
        try:
            await pool.engines.abort_request(e.url, abort_all=True, timeout_s=5.0)
            info = await pool.engines.server_info(e.url, timeout_s=5.0)
        except PhysarumError:
            break
        states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
        if not sum(int(s.get("num_running_reqs", 0)) + int(s.get("num_waiting_reqs", 0)) for s in states):
            break
        await asyncio.sleep(0.2)
    await pool.retire(e)
    pool.event("stop", e.name, e.url)
