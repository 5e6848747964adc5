"""Every rank's source of rollouts, one feed per training mode, chosen once by `make_feed`: where the samples of
rollout i come from, what runs alongside training, and when the weights go to the engines.

- sync (slime's train.py): rollout i is generated after the weights of rollout i-1 reached the engines.
- one_step_async (slime's train_async.py): rollout i+1 starts before rollout i trains; before a weight update the
  trainer waits for it, so each rollout comes from one policy, one version behind.
- fully_async: the manager streams groups across rollouts (rollout -2 in the buffer, max_inflight_groups bound);
  rollout i takes the first finished groups whose oldest token is at most max_weight_staleness versions behind the
  trainer's weights (buffer TakeBatch; staler ones are regenerated or dropped and counted).

The feed owns all that rank 0 does for the driver: the rollout manager, the buffer's data-source state, the job's
events and metrics sinks; each of its rank-0 parts runs through `world.on_rank0`, so a failure there ends the job on
every rank. Samples never travel between ranks: rank 0 waits for a rollout with its own share (`Share`), tells the
others it is complete (a flag), and each reads its own share from the buffer (or from a replayed dump).
A rollout id's groups stay in the buffer under that id, so a trainer that resumes gets the same groups again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

from services.buffer.client import STREAM_ROLLOUT_ID, DataSourceState
from services.common.errors import DeadlineExceeded, PhysarumError, Unavailable
from services.common.rollout_stats import RolloutStats
from services.common.samples import Sample, SampleGroup, weight_version_range
from services.common.settings.rollout import RolloutConfig
from services.common.shares import Share, share_positions
from services.rollout.client import RolloutState
from services.trainer.checkpoint import iterations
from services.trainer.distributed.parallel import RankAborted, shard_rollout
from services.trainer.driver import wandb_log
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.intervals import should_run_periodic_action
from services.trainer.driver.job import JobControl
from services.trainer.driver.metrics import CHECKPOINTS, MetricsWriter
from services.trainer.driver.post_rollout import generation_metrics
from services.trainer.settings.driver import DriverConfig
from services.trainer.weight_sync.versions import EngineWeights

log = logging.getLogger(__name__)

POLL_S = 2.0
START_RETRY_S = 1.0  # between StartRollout attempts while the manager is unavailable
READ_SHARE_S = 60.0  # ranks > 0 read a rollout rank 0 found complete: its groups are all in the buffer


class RolloutFeed:
    """The sync feed, and the base of the others. Every rank calls its public methods, in the same order; the
    underscored ones run on rank 0 alone. `samples(i)` is this rank's share of rollout i, generated with the weights
    the engines hold (`weights.version`; the trainer's own before training rollout i are version i)."""

    def __init__(self, driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, ctx: JobControl | None,
                 weights: EngineWeights | None = None, share: Share = Share()) -> None:
        self.driver, self.config, self.deps, self.ctx = driver, rollout, deps, ctx
        self.world, self.job_id, self.share = deps.world, driver.job_id, share
        self.weights = weights or EngineWeights(deps.world, deps.rollout, engines=False)
        self.mine: list[Sample] = []  # rank 0: its share of the rollout in hand
        self.writer: MetricsWriter | None = None  # rank 0's metrics sinks, opened with the first report

    # -- every rank

    def samples(self, rollout_id: int) -> list[Sample]:
        """This rank's share of rollout `rollout_id`, in group_id order. Every rank learns whether every other
        read its share, so a rank that could not does not leave the others waiting in training's collectives."""
        self.world.on_rank0(self._take_mine, rollout_id)
        if self.world.rank == 0:
            mine, self.mine, failed = self.mine, [], None
        else:
            try:
                mine, failed = self._read_mine(rollout_id), None
            except Exception as err:  # noqa: BLE001 - raised below, on every rank
                mine, failed = [], f"{type(err).__name__}: {err}"
        if failures := [(rank, why) for rank, why in enumerate(self.world.gather(failed)) if why]:
            rank, why = failures[0]
            raise RankAborted(f"rank {rank} could not read its share of rollout {rollout_id}: {why}")
        return mine

    def started(self, rollout_id: int) -> None:
        """Right after every rank has rollout `rollout_id` in hand."""
        self.world.on_rank0(self._started, rollout_id)

    def before_weight_update(self, rollout_id: int) -> dict[str, float]:
        """Before the weights of rollout `rollout_id` go to the engines; returns perf metrics."""
        return self.world.on_rank0(self._before_weight_update, rollout_id)

    def rollout_metrics(self, samples: list[Sample], version: int) -> dict[str, float]:
        """The rollout/* metrics of the whole rollout from every rank's share (sums gathered, not samples), with how
        many versions behind the trainer's weights (`version`) each sample's oldest token is."""
        return combine_rollout_stats(self.world.gather(rollout_sums(samples, version)))

    def after_rollout(self, rollout_id: int) -> dict[str, float]:
        """After the weight sync of rollout `rollout_id`: the manager's counters, eval when due, the feed's own."""
        if not self.driver.engines:
            return {}
        return self.world.on_rank0(self._after_rollout, rollout_id)

    def report(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self.world.on_rank0(self._report, rollout_id, metrics)

    def resumed(self, start_id: int, buffer_state: dict | None, metrics: dict[str, float] | None = None) -> None:
        """The job resumes at rollout `start_id`: the buffer's data source goes back to the checkpoint's state, and
        the checkpoint's rollout's metrics are reported unless they were before the trainer stopped."""
        self.world.on_rank0(self._resumed, start_id, buffer_state, metrics)

    def trainer_state(self, rollout_id: int) -> iterations.TrainerState:
        """Rank 0 (iterations.save_checkpoint calls it there): the driver's part of checkpoint `rollout_id`, with
        the buffer's snapshot (no rollout is running)."""
        driver = self.driver
        buffer = None if driver.train_only else self.deps.buffer.save_state(driver.job_id, rollout_id).to_dict()
        CHECKPOINTS.inc()
        return iterations.TrainerState(rollout_id=rollout_id, job_id=driver.job_id,
                                        world_size=self.world.world_size, buffer=buffer)

    every_rollout = True  # sync pushes weights after every rollout; the async modes every update_weights_interval

    def weight_update_due(self, rollout_id: int) -> bool:
        """Whether the weights of rollout `rollout_id` go to the engines (the async modes: also after the last);
        decided from the job's settings alone, the same on every rank."""
        return self.driver.engines and (self.every_rollout or should_run_periodic_action(
            rollout_id, self.driver.update_weights_interval, num_rollout=self.driver.num_rollout))

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """End what the feed runs in the background and close the metrics sinks; never raises."""
        if self.writer is not None:
            self.writer.close()

    # -- rank 0

    def rollout(self, rollout_id: int, share: Share) -> list[Sample]:
        """Rank 0: `share` of rollout `rollout_id` (from the engines or a debug dump), dumping the whole rollout
        when asked."""
        self.ctx.check_cancelled()
        driver = self.driver
        if driver.load_debug_rollout_data:
            return self._dumped(rollout_id, share)
        whole = Share() if driver.save_debug_rollout_data else share
        groups = sorted(self._groups(rollout_id, self.weights.version, whole), key=lambda g: g.group_id)
        if driver.save_debug_rollout_data:
            iterations.save_debug_rollout_data(driver.save_debug_rollout_data, rollout_id, _flat(groups))
            positions = share_positions([g.group_id for g in groups],
                                        [sum(len(s.tokens) for s in g.samples) for g in groups], share)
            groups = [groups[i] for i in positions]
        return _flat(groups)

    def _take_mine(self, rollout_id: int) -> None:
        self.mine = self.rollout(rollout_id, self.share)

    def _read_mine(self, rollout_id: int) -> list[Sample]:
        """Ranks > 0: this rank's share of a rollout rank 0 found complete."""
        if self.driver.load_debug_rollout_data:
            return self._dumped(rollout_id, self.share)
        return _flat(self.deps.buffer.get_batch(self.job_id, rollout_id, self.config.rollout_batch_size,
                                                timeout_s=READ_SHARE_S, share=self.share))

    def _dumped(self, rollout_id: int, share: Share) -> list[Sample]:
        samples = iterations.load_debug_rollout_data(self.driver.load_debug_rollout_data, rollout_id)
        return shard_rollout(samples, share, self.config.n_samples_per_prompt) if not share.whole else samples

    def _started(self, rollout_id: int) -> None:
        """After rollout `rollout_id` is in hand."""

    def _before_weight_update(self, rollout_id: int) -> dict[str, float]:
        return {}

    def _after_rollout(self, rollout_id: int) -> dict[str, float]:
        return {**generation_metrics(self.driver, self.config, self.deps, rollout_id), **self.metrics()}

    def _report(self, rollout_id: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            self.writer = metrics_writer(self.driver, self.deps, self.config.args)
        self.writer.write(rollout_id, metrics)
        self.ctx.report(rollout_id, metrics)
        log.info("job %s rollout %d: reward %.3f loss %.4f (rollout %.1f s, train %.1f s)", self.job_id, rollout_id,
                 metrics["rollout/reward_mean"], metrics.get("train/loss", float("nan")),
                 metrics["perf/rollout_seconds"], metrics["perf/train_seconds"])

    def _resumed(self, start_id: int, buffer_state: dict | None, metrics: dict[str, float] | None) -> None:
        if buffer_state is not None and self.driver.engines:
            self.deps.buffer.restore_state(self.job_id, DataSourceState.from_dict(buffer_state))
        if metrics and not self.ctx.has_metrics(start_id - 1):  # killed between the checkpoint and its report
            self.ctx.report(start_id - 1, metrics, f"rollout {start_id - 1}'s metrics, kept with its checkpoint")
        self.ctx.report(start_id - 1, {}, f"resumed from {self.driver.load} at rollout {start_id}")

    def _groups(self, rollout_id: int, version: int, share: Share) -> list[SampleGroup]:
        return self._collect(rollout_id, version, share)

    # -- the two ways of getting a rollout's groups

    def _collect(self, rollout_id: int, version: int, share: Share) -> list[SampleGroup]:
        """Ask the manager for rollout `rollout_id` and wait for its groups in the buffer (`share` of them)."""
        deps, config = self.deps, self.config
        self._start(rollout_id, version)
        return self._wait(rollout_id, rollout_id, version, lambda timeout_s: deps.buffer.get_batch(
            self.job_id, rollout_id, config.rollout_batch_size, timeout_s=timeout_s, share=share))

    def _take(self, rollout_id: int, version: int, share: Share) -> list[SampleGroup]:
        """fully_async: make sure the stream runs, then take rollout_batch_size groups from it whose oldest token is
        at most max_weight_staleness versions behind the trainer's weights (version rollout_id) and none newer: a
        newer one came from a policy a trainer had after the checkpoint this one resumed from. `share` of them
        comes back; the other ranks read theirs from the rollout the take filled."""
        driver, deps = self.driver, self.deps
        self._start(STREAM_ROLLOUT_ID, version)

        def take(timeout_s: float) -> list[SampleGroup]:
            batch = deps.buffer.take_batch(self.job_id, rollout_id, self.config.rollout_batch_size,
                                           min_weight_version=rollout_id - driver.max_weight_staleness,
                                           max_weight_version=rollout_id, stale_policy=driver.stale_policy,
                                           timeout_s=timeout_s, share=share)
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
                self.weights.announce()
                self.deps.rollout.start_rollout(self.config, manager_rollout_id, str(version))
                self.weights.announce()
                return
            except Unavailable as err:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"rollout {manager_rollout_id} of job {self.job_id}: the rollout manager "
                                           f"was unavailable for {self.driver.rollout_timeout_s} s ({err})") from err
                log.warning("rollout manager unavailable at the start of rollout %d (%s); waiting",
                            manager_rollout_id, err)
                time.sleep(START_RETRY_S)

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
                    self.weights.announce()
            except Unavailable as err:
                log.warning("rollout manager unavailable (%s); waiting", err)


class OneStepAsyncFeed(RolloutFeed):
    """one_step_async: rollout i+1 generates while rollout i trains; weights go out every update_weights_interval
    rollouts and after the last, once the next rollout finished with the weights it started with."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ready: dict[int, list[SampleGroup]] = {}  # rank 0: rollouts waited for before an update

    every_rollout = False

    def _started(self, rollout_id: int) -> None:
        """Start the next rollout, generated while this one trains."""
        if rollout_id + 1 < self.driver.num_rollout:
            self._start(rollout_id + 1, self.weights.version)

    def _before_weight_update(self, rollout_id: int) -> dict[str, float]:
        """The next rollout finishes with the weights it started with (slime waits likewise)."""
        start = time.monotonic()
        if rollout_id + 1 < self.driver.num_rollout:
            share = Share() if self.driver.save_debug_rollout_data else self.share
            self.ready[rollout_id + 1] = self._collect(rollout_id + 1, self.weights.version, share)
        return {"perf/wait_next_rollout_seconds": time.monotonic() - start}

    def _groups(self, rollout_id: int, version: int, share: Share) -> list[SampleGroup]:
        if rollout_id in self.ready:
            return self.ready.pop(rollout_id)
        return self._collect(rollout_id, version, share)


class FullyAsyncFeed(RolloutFeed):
    """fully_async: rollouts come from the manager's stream, within the staleness bound."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stale = {"buffer/stale_dropped": 0.0, "buffer/stale_regenerated": 0.0}

    every_rollout = False

    def metrics(self) -> dict[str, float]:
        return dict(self.stale)

    def close(self) -> None:
        """End the stream (its in-flight prompts go back to the buffer)."""
        if self.world.rank == 0 and self.deps.rollout is not None:
            with contextlib.suppress(PhysarumError):
                self.deps.rollout.stop_rollout(self.job_id, STREAM_ROLLOUT_ID)
        super().close()

    def _groups(self, rollout_id: int, version: int, share: Share) -> list[SampleGroup]:
        return self._take(rollout_id, version, share)


FEEDS: dict[str, type[RolloutFeed]] = {"sync": RolloutFeed, "one_step_async": OneStepAsyncFeed,
                                       "fully_async": FullyAsyncFeed}


def make_feed(driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, ctx: JobControl | None,
              weights: EngineWeights | None = None, share: Share = Share()) -> RolloutFeed:
    """The feed of the job's mode, for this rank's `share` of each rollout."""
    return FEEDS[driver.mode](driver, rollout, deps, ctx, weights, share)


def metrics_writer(driver: DriverConfig, deps: TrainerDeps, args: dict) -> MetricsWriter:
    """TensorBoard files (and a W&B run under use_wandb, logging the job's `args` as its config)."""
    tensorboard = Path(deps.tensorboard_dir) / driver.job_id if deps.tensorboard_dir else \
        Path(driver.save) / "tensorboard" if driver.save else None
    return MetricsWriter(tensorboard, wandb_log.start(driver, args), job_id=driver.job_id)


def _flat(groups: list[SampleGroup]) -> list[Sample]:
    """The groups' samples in group order; each sample of a group with images refers to the group's list."""
    samples = []
    for group in sorted(groups, key=lambda g: g.group_id):
        for sample in group.samples:
            if group.images:
                sample.images = group.images
            samples.append(sample)
    return samples


def rollout_sums(samples: list[Sample], version: int) -> dict[str, float]:
    """One rank's part of the rollout/* metrics, as sums that add up over the ranks."""
    stats = RolloutStats.of(samples)
    behind = [version - weight_version_range([s])[0] for s in samples if s.weight_versions]
    return {"n": stats.num_samples, "reward": stats.reward_sum, "reward_sq": sum(s.reward ** 2 for s in samples),
            "response_len": stats.response_len_sum, "truncated": stats.num_truncated,
            "failed": sum(bool(s.reward_error) for s in samples), "behind_n": len(behind), "behind": sum(behind),
            "behind_max": max(behind, default=-math.inf)}


def combine_rollout_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """The manager's rollout/* means, the reward spread, the share of failed rewards and, when the samples carry
    weight versions, how stale they are (0 in sync mode), from every rank's `rollout_sums`."""
    total = {key: sum(p[key] for p in parts) for key in parts[0] if key != "behind_max"}
    n = total["n"]
    if not n:
        return {}
    stats = RolloutStats(num_samples=int(n), reward_sum=total["reward"], response_len_sum=int(total["response_len"]),
                         num_truncated=int(total["truncated"]))
    mean = total["reward"] / n
    metrics = {**stats.metrics(), "rollout/reward_std": math.sqrt(max(0.0, total["reward_sq"] / n - mean ** 2)),
               "rollout/reward_failed_ratio": total["failed"] / n}
    if total["behind_n"]:
        metrics["rollout/weight_staleness_max"] = float(max(p["behind_max"] for p in parts))
        metrics["rollout/weight_staleness_mean"] = total["behind"] / total["behind_n"]
    return metrics
