"""A job's rollouts as every rank gets them: rank 0 has the rollout manager generate them and waits for their groups
in the buffer (or replays a debug dump); every other rank then reads its own share of the same rollout from the buffer.

Samples never travel between ranks: rank 0 waits for a rollout with its own share (`Share`), tells the others it is
complete (a flag), and each reads its own share. A rollout id's groups stay in the buffer under that id, so a trainer
that resumes gets the same groups again. Which rollout is generated when is the mode's (`loop.py`); the two ways of
getting one are here: `collect` (a rollout the manager runs by its id) and `take` (fully_async: groups from the
manager's stream, within the staleness bound).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable

from services.buffer.client import STREAM_ROLLOUT_ID, DataSourceState
from services.common.errors import DeadlineExceeded, PhysarumError, Unavailable
from services.common.rollout_stats import RolloutStats
from services.common.samples import Sample, SampleGroup, weight_version_range
from services.common.settings.rollout import RolloutConfig
from services.common.shares import Share, share_positions
from services.rollout.client import RolloutState
from services.trainer.checkpoint import iterations
from services.trainer.distributed.parallel import RankAborted, shard_rollout
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.job import JobControl
from services.trainer.settings.driver import DriverConfig
from services.trainer.weight_sync.versions import EngineWeights

log = logging.getLogger(__name__)

POLL_S = 2.0
START_RETRY_S = 1.0  # between StartRollout attempts while the manager is unavailable
READ_SHARE_S = 60.0  # ranks > 0 read a rollout rank 0 found complete: its groups are all in the buffer

# rank 0's way of getting `share` of a rollout's groups: `collect` or `take` (or a rollout waited for before)
GroupSource = Callable[[Share], list[SampleGroup]]


class Rollouts:
    """A job's rollouts on this rank. Every rank calls `samples` in the same order; the other methods are rank 0's.
    Rollouts are generated with the weights the engines hold (`weights.version`: the trainer's own before training
    rollout i are version i)."""

    def __init__(self, driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, ctx: JobControl | None,
                 weights: EngineWeights | None = None, share: Share = Share()) -> None:
        self.driver, self.config, self.deps, self.ctx = driver, rollout, deps, ctx
        self.world, self.job_id, self.share = deps.world, driver.job_id, share
        self.weights = weights or EngineWeights(deps.world, deps.rollout, engines=False)
        self.stale = {"buffer/stale_dropped": 0.0, "buffer/stale_regenerated": 0.0}  # the last take's

    # -- every rank

    def samples(self, rollout_id: int, groups: GroupSource) -> list[Sample]:
        """This rank's share of rollout `rollout_id`, in group_id order; rank 0 gets its own from `groups`. Every
        rank learns whether every other read its share, so a rank that could not does not leave the others waiting
        in training's collectives."""
        mine: list[Sample] = []

        def take_mine() -> None:  # only the news that the rollout is complete travels, not the samples
            mine.extend(self.rollout(rollout_id, groups))

        self.world.on_rank0(take_mine)
        if self.world.rank == 0:
            failed = None
        else:
            try:
                mine, failed = self._read_mine(rollout_id), None
            except Exception as err:  # noqa: BLE001 - raised below, on every rank
                mine, failed = [], f"{type(err).__name__}: {err}"
        if failures := [(rank, why) for rank, why in enumerate(self.world.gather(failed)) if why]:
            rank, why = failures[0]
            raise RankAborted(f"rank {rank} could not read its share of rollout {rollout_id}: {why}")
        return mine

    def rollout_metrics(self, samples: list[Sample], version: int) -> dict[str, float]:
        """The rollout/* metrics of the whole rollout from every rank's share (sums gathered, not samples), with how
        many versions behind the trainer's weights (`version`) each sample's oldest token is."""
        return combine_rollout_stats(self.world.gather(rollout_sums(samples, version)))

    # -- rank 0

    def rollout(self, rollout_id: int, groups: GroupSource) -> list[Sample]:
        """Rank 0: its share of rollout `rollout_id` (from `groups`, or a debug dump), dumping the whole rollout
        when asked."""
        self.ctx.check_cancelled()
        driver = self.driver
        if driver.load_debug_rollout_data:
            return self._dumped(rollout_id, self.share)
        whole = Share() if driver.save_debug_rollout_data else self.share
        got = sorted(groups(whole), key=lambda g: g.group_id)
        if driver.save_debug_rollout_data:
            iterations.save_debug_rollout_data(driver.save_debug_rollout_data, rollout_id, _flat(got))
            positions = share_positions([g.group_id for g in got],
                                        [sum(len(s.tokens) for s in g.samples) for g in got], self.share)
            got = [got[i] for i in positions]
        return _flat(got)

    def collect(self, rollout_id: int, share: Share) -> list[SampleGroup]:
        """Have the manager run rollout `rollout_id` (if it does not already) and wait for `share` of its groups in
        the buffer."""
        deps, config = self.deps, self.config
        self.start(rollout_id)
        return self._wait(rollout_id, rollout_id, lambda timeout_s: deps.buffer.get_batch(
            self.job_id, rollout_id, config.rollout_batch_size, timeout_s=timeout_s, share=share))

    def take(self, rollout_id: int, share: Share) -> list[SampleGroup]:
        """fully_async: make sure the stream runs, then take rollout_batch_size groups from it whose oldest token is
        at most max_weight_staleness versions behind the trainer's weights (version rollout_id) and none newer: a
        newer one came from a policy a trainer had after the checkpoint this one resumed from. `share` of them
        comes back; the other ranks read theirs from the rollout the take filled."""
        driver, deps = self.driver, self.deps
        self.start(STREAM_ROLLOUT_ID)

        def take(timeout_s: float) -> list[SampleGroup]:
            batch = deps.buffer.take_batch(self.job_id, rollout_id, self.config.rollout_batch_size,
                                           min_weight_version=rollout_id - driver.max_weight_staleness,
                                           max_weight_version=rollout_id, stale_policy=driver.stale_policy,
                                           timeout_s=timeout_s, share=share)
            self.stale = {"buffer/stale_dropped": float(batch.num_stale_dropped),
                          "buffer/stale_regenerated": float(batch.num_stale_regenerated)}
            return batch.groups

        return self._wait(rollout_id, STREAM_ROLLOUT_ID, take)

    def stop_stream(self) -> None:
        """fully_async's end: stop the stream (its in-flight prompts go back to the buffer); never raises."""
        if self.deps.rollout is not None:
            with contextlib.suppress(PhysarumError):
                self.deps.rollout.stop_rollout(self.job_id, STREAM_ROLLOUT_ID)

    def resumed(self, start_id: int, buffer_state: dict | None, metrics: dict[str, float] | None = None) -> None:
        """The job resumes at rollout `start_id`: the buffer's data source goes back to the checkpoint's state, and
        the checkpoint's rollout's metrics are reported unless they were before the trainer stopped."""
        if buffer_state is not None and self.driver.engines:
            self.deps.buffer.restore_state(self.job_id, DataSourceState.from_dict(buffer_state))
        if metrics and not self.ctx.has_metrics(start_id - 1):  # killed between the checkpoint and its report
            self.ctx.report(start_id - 1, metrics, f"rollout {start_id - 1}'s metrics, kept with its checkpoint")
        self.ctx.report(start_id - 1, {}, f"resumed from {self.driver.load} at rollout {start_id}")

    def start(self, manager_rollout_id: int) -> None:
        """Have the manager run `manager_rollout_id` with the engines holding the trainer's last push. Announced
        again after the start: a manager that restarted in between got the start but not the weights. A manager
        that is down or still starting its pool (UNAVAILABLE) is waited for, up to rollout_timeout_s."""
        deadline = time.monotonic() + self.driver.rollout_timeout_s
        while True:
            self.ctx.check_cancelled()
            try:
                self.weights.announce()
                self.deps.rollout.start_rollout(self.weights.rollout_config(self.config), manager_rollout_id,
                                                str(self.weights.version))
                self.weights.announce()
                return
            except Unavailable as err:
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"rollout {manager_rollout_id} of job {self.job_id}: the rollout manager "
                                           f"was unavailable for {self.driver.rollout_timeout_s} s ({err})") from err
                log.warning("rollout manager unavailable at the start of rollout %d (%s); waiting",
                            manager_rollout_id, err)
                time.sleep(START_RETRY_S)

    def _wait(self, rollout_id: int, manager_rollout_id: int, fetch) -> list[SampleGroup]:
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
                    self.start(manager_rollout_id)
                else:  # a manager that restarted after the start runs the rollout: its engines need the weights too
                    self.weights.announce()
            except Unavailable as err:
                log.warning("rollout manager unavailable (%s); waiting", err)

    # -- ranks > 0

    def _read_mine(self, rollout_id: int) -> list[Sample]:
        """This rank's share of a rollout rank 0 found complete."""
        if self.driver.load_debug_rollout_data:
            return self._dumped(rollout_id, self.share)
        return _flat(self.deps.buffer.get_batch(self.job_id, rollout_id, self.config.rollout_batch_size,
                                                timeout_s=READ_SHARE_S, share=self.share))

    def _dumped(self, rollout_id: int, share: Share) -> list[Sample]:
        samples = iterations.load_debug_rollout_data(self.driver.load_debug_rollout_data, rollout_id)
        return shard_rollout(samples, share, self.config.n_samples_per_prompt) if not share.whole else samples


def _flat(groups: list[SampleGroup]) -> list[Sample]:
    """The groups' samples in group order; each sample of a group with images refers to the group's list, one whose
    turns added images (observation_images) has its own: the group's, then those."""
    samples = []
    for group in sorted(groups, key=lambda g: g.group_id):
        for sample in group.samples:
            if sample.observation_images:
                sample.images = [*group.images, *sample.observation_images]
            elif group.images:
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
