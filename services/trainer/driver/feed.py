"""Rank 0's source of rollouts, one feed per training mode, chosen once by `make_feed`: where the samples of rollout
i come from, what runs alongside training, and when the weights go to the engines.

- sync (slime's train.py): rollout i is generated after the weights of rollout i-1 reached the engines.
- one_step_async (slime's train_async.py): rollout i+1 starts before rollout i trains; before a weight update the
  trainer waits for it, so each rollout comes from one policy, one version behind.
- fully_async: the manager streams groups across rollouts (rollout -2 in the buffer, max_inflight_groups bound);
  rollout i takes the first finished groups whose oldest token is at most max_weight_staleness versions behind the
  trainer's weights (buffer TakeBatch; staler ones are regenerated or dropped and counted).

A rollout id's groups stay in the buffer under that id, so a trainer that resumes gets the same groups again.
"""

from __future__ import annotations

import contextlib
import logging
import time

from services.buffer.client import STREAM_ROLLOUT_ID
from services.common.errors import DeadlineExceeded, PhysarumError, Unavailable
from services.common.samples import Sample, SampleGroup, weight_version_range
from services.rollout.client import RolloutConfig, RolloutState, snapshot_path
from services.trainer.driver import checkpoint
from services.trainer.driver.config import DriverConfig
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.intervals import should_run_periodic_action
from services.trainer.jobs import JobContext

log = logging.getLogger(__name__)

POLL_S = 2.0
START_RETRY_S = 1.0  # between StartRollout attempts while the manager is unavailable


class RolloutFeed:
    """The sync feed, and the base of the others. Rank 0: `samples(i, version)` is rollout i (version: the weights
    the engines hold; the trainer's own before training rollout i are version i); `started` runs right after it,
    `before_weight_update` before each push of the weights to the engines; `close` at the end."""

    def __init__(self, driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, ctx: JobContext) -> None:
        self.driver, self.config, self.deps, self.ctx = driver, rollout, deps, ctx
        self.job_id = driver.job_id
        self.unannounceable: set[int] = set()  # versions without a snapshot to announce (warned once each)

    def samples(self, rollout_id: int, version: int) -> list[Sample]:
        """Rollout `rollout_id`'s samples in group order (from the engines or a debug dump); dumped when asked."""
        self.ctx.check_cancelled()
        driver = self.driver
        if driver.load_debug_rollout_data:
            samples = checkpoint.load_debug_rollout_data(driver.load_debug_rollout_data, rollout_id)
        else:
            groups = self._groups(rollout_id, version)
            samples = [s for g in sorted(groups, key=lambda g: g.group_id) for s in g.samples]
        if driver.save_debug_rollout_data:
            checkpoint.save_debug_rollout_data(driver.save_debug_rollout_data, rollout_id, samples)
        return samples

    every_rollout = True  # sync pushes weights after every rollout; the async modes every update_weights_interval

    def weight_update_due(self, rollout_id: int) -> bool:
        """Whether the weights of rollout `rollout_id` go to the engines (the async modes: also after the last)."""
        return self.every_rollout or should_run_periodic_action(rollout_id, self.driver.update_weights_interval,
                                                                num_rollout=self.driver.num_rollout)

    def started(self, rollout_id: int, version: int) -> None:
        """After rollout `rollout_id` is in hand."""

    def before_weight_update(self, rollout_id: int, version: int) -> dict[str, float]:
        """Before the weights of rollout `rollout_id` go to the engines; returns perf metrics."""
        return {}

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """End what the feed runs in the background; never raises."""

    def _groups(self, rollout_id: int, version: int) -> list[SampleGroup]:
        return self._collect(rollout_id, version)

    # -- the two ways of getting a rollout's groups

    def _collect(self, rollout_id: int, version: int) -> list[SampleGroup]:
        """Ask the manager for rollout `rollout_id` and wait for its groups in the buffer."""
        deps, config = self.deps, self.config
        self._start(rollout_id, version)
        return self._wait(rollout_id, rollout_id, version, lambda timeout_s: deps.buffer.get_batch(
            self.job_id, rollout_id, config.rollout_batch_size, timeout_s=timeout_s))

    def _take(self, rollout_id: int, version: int) -> list[SampleGroup]:
        """fully_async: make sure the stream runs, then take rollout_batch_size groups from it whose oldest token is
        at most max_weight_staleness versions behind the trainer's weights (version rollout_id) and none newer: a
        newer one came from a policy a trainer had after the checkpoint this one resumed from."""
        driver, deps = self.driver, self.deps
        self._start(STREAM_ROLLOUT_ID, version)

        def take(timeout_s: float) -> list[SampleGroup]:
            batch = deps.buffer.take_batch(self.job_id, rollout_id, self.config.rollout_batch_size,
                                           min_weight_version=rollout_id - driver.max_weight_staleness,
                                           max_weight_version=rollout_id, stale_policy=driver.stale_policy,
                                           timeout_s=timeout_s)
            self.stale = {"buffer/stale_dropped": float(batch.num_stale_dropped),
                          "buffer/stale_regenerated": float(batch.num_stale_regenerated)}
            return batch.groups

        return self._wait(rollout_id, STREAM_ROLLOUT_ID, version, take)

    def _start(self, manager_rollout_id: int, version: int) -> None:
        """Have the manager run `manager_rollout_id` with the engines holding `version` (the trainer's last push).
        Announced again after the start: a manager that restarted in between got the start but not the weights.
        A manager that is down or still starting its pool (UNAVAILABLE) is waited for, up to rollout_timeout_s."""
        deadline = time.monotonic() + self.driver.rollout_timeout_s
        while True:
            self.ctx.check_cancelled()
            try:
                self._announce_weights(version)
                self.deps.rollout.start_rollout(self.config, manager_rollout_id, str(version))
                self._announce_weights(version)
                return
            except Unavailable as err:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"rollout {manager_rollout_id} of job {self.job_id}: the rollout manager "
                                           f"was unavailable for {self.driver.rollout_timeout_s} s ({err})") from err
                log.warning("rollout manager unavailable at the start of rollout %d (%s); waiting",
                            manager_rollout_id, err)
                time.sleep(START_RETRY_S)

    def _announce_weights(self, version: int) -> None:
        """A rollout manager that restarted knows no weights: its new engines serve the base model, and in fully_async
        every group they generate would be refused as stale while the trainer, waiting for fresh ones, never pushes
        weights again. Tell its pool the version the trainer last pushed, with the snapshot written at that push
        (weight_v<version> in the pool's snapshot_dir): its engines load it as they do when joining (disk join)."""
        if self.driver.debug_rollout_only:  # no push: the engines keep whatever weights they hold
            return
        rollout = self.deps.rollout
        pool = rollout.pool_status()
        if pool.weight_version == str(version):
            return
        snapshot = snapshot_path(pool.snapshot_dir, version) if pool.snapshot_dir else None
        if snapshot is None or not (snapshot / "model.safetensors").is_file():
            if version in self.unannounceable:
                return
            self.unannounceable.add(version)
            log.warning("the rollout manager's pool holds weight version %r, not %d, and there is no snapshot of %d "
                        "(join mode sync?): its engines get the trainer's weights with the next sync",
                        pool.weight_version, version, version)
            return
        rollout.begin_weight_sync(str(version))
        rollout.end_weight_sync(str(version), success=True, engine_urls=[], snapshot_path=str(snapshot))
        log.warning("the rollout manager's pool held weight version %r, not %d (restarted?): announced %d with its "
                    "snapshot %s", pool.weight_version, version, version, snapshot)

    def _wait(self, rollout_id: int, manager_rollout_id: int, version: int, fetch) -> list[SampleGroup]:
        """Poll `fetch` until it returns; between polls check the manager's run (`manager_rollout_id`): a manager
        that restarted reports it UNKNOWN and is asked again (the buffer's leases lose no prompt), a failed one
        fails the job."""
        deps, job_id, timeout_s = self.deps, self.job_id, self.driver.rollout_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            self.ctx.check_cancelled()
            try:
                return fetch(POLL_S)
            except (DeadlineExceeded, Unavailable) as err:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"rollout {rollout_id} of job {job_id}: not complete after "
                                           f"{timeout_s} s ({err})") from err
            try:
                status = deps.rollout.rollout_status(job_id, manager_rollout_id)
                if status.state == RolloutState.FAILED:
                    raise RuntimeError(f"rollout {manager_rollout_id} of job {job_id} failed: {status.error}")
                if status.state == RolloutState.UNKNOWN or (status.state == RolloutState.DONE
                                                            and manager_rollout_id == STREAM_ROLLOUT_ID):
                    log.warning("rollout manager does not run rollout %d (restarted?); starting it again",
                                manager_rollout_id)
                    self._start(manager_rollout_id, version)
                else:  # a manager that restarted after the start runs the rollout: its engines need the weights too
                    self._announce_weights(version)
            except Unavailable as err:
                log.warning("rollout manager unavailable (%s); waiting", err)


class OneStepAsyncFeed(RolloutFeed):
    """one_step_async: rollout i+1 generates while rollout i trains; weights go out every update_weights_interval
    rollouts and after the last, once the next rollout finished with the weights it started with."""

    def __init__(self, driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, ctx: JobContext) -> None:
        super().__init__(driver, rollout, deps, ctx)
        self.ready: dict[int, list[SampleGroup]] = {}  # rollouts waited for before an update

    every_rollout = False

    def started(self, rollout_id: int, version: int) -> None:
        """Start the next rollout, generated while this one trains."""
        if rollout_id + 1 < self.driver.num_rollout:
            self._start(rollout_id + 1, version)

    def before_weight_update(self, rollout_id: int, version: int) -> dict[str, float]:
        """The next rollout finishes with the weights it started with (slime waits likewise)."""
        start = time.monotonic()
        if rollout_id + 1 < self.driver.num_rollout:
            self.ready[rollout_id + 1] = self._collect(rollout_id + 1, version)
        return {"perf/wait_next_rollout_seconds": time.monotonic() - start}

    def _groups(self, rollout_id: int, version: int) -> list[SampleGroup]:
        if rollout_id in self.ready:
            return self.ready.pop(rollout_id)
        return self._collect(rollout_id, version)


class FullyAsyncFeed(RolloutFeed):
    """fully_async: rollouts come from the manager's stream, within the staleness bound."""

    def __init__(self, driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, ctx: JobContext) -> None:
        super().__init__(driver, rollout, deps, ctx)
        self.stale = {"buffer/stale_dropped": 0.0, "buffer/stale_regenerated": 0.0}

    every_rollout = False

    def metrics(self) -> dict[str, float]:
        return dict(self.stale)

    def close(self) -> None:
        """End the stream (its in-flight prompts go back to the buffer)."""
        with contextlib.suppress(PhysarumError):
            self.deps.rollout.stop_rollout(self.job_id, STREAM_ROLLOUT_ID)

    def _groups(self, rollout_id: int, version: int) -> list[SampleGroup]:
        return self._take(rollout_id, version)


FEEDS: dict[str, type[RolloutFeed]] = {"sync": RolloutFeed, "one_step_async": OneStepAsyncFeed,
                                       "fully_async": FullyAsyncFeed}


def make_feed(driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, ctx: JobContext) -> RolloutFeed:
    """The feed of the job's mode."""
    return FEEDS[driver.mode](driver, rollout, deps, ctx)


def staleness_metrics(samples: list[Sample], version: int) -> dict[str, float]:
    """How many versions behind the trainer's weights (`version`) each sample's oldest token is (0 in sync mode)."""
    behind = [version - weight_version_range([s])[0] for s in samples if s.weight_versions]
    if not behind:
        return {}
    return {"rollout/weight_staleness_max": float(max(behind)),
            "rollout/weight_staleness_mean": sum(behind) / len(behind)}
