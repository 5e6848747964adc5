"""The steps of one rollout that every mode's driver takes (`loop.py`), on every rank: get this rank's share, train
on it, save a checkpoint when due, push the weights to the engines, collect the manager's counters and eval, report.

Every method is called by every rank in the same order; what rank 0 alone does (the manager, the buffer's state,
the job's events and metrics sinks) runs through `world.on_rank0`, so a failure there ends the job on every rank.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from pathlib import Path

from services.common.samples import Sample
from services.common.settings.rollout import RolloutConfig
from services.trainer.backends.base import TrainBackend
from services.trainer.checkpoint import iterations
from services.trainer.distributed.parallel import RankAborted
from services.trainer.driver import post_rollout, wandb_log
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.intervals import should_run_periodic_action
from services.trainer.driver.job import JobControl, JobPreempted, preempted
from services.trainer.driver.metrics import CHECKPOINTS, MetricsWriter
from services.trainer.driver.rollouts import GroupSource, Rollouts
from services.trainer.settings.driver import DriverConfig
from services.trainer.weight_sync.versions import EngineWeights

log = logging.getLogger(__name__)


class JobRun:
    """One job's training on this rank: its backend, the engines' weights and the rollouts, and the steps a mode
    takes with them."""

    def __init__(self, driver: DriverConfig, rollout: RolloutConfig, backend: TrainBackend, weights: EngineWeights,
                 rollouts: Rollouts, ctx: JobControl | None, deps: TrainerDeps) -> None:
        self.driver, self.rollout, self.backend = driver, rollout, backend
        self.weights, self.rollouts = weights, rollouts
        self.ctx, self.deps, self.world = ctx, deps, deps.world
        self.saved = -1  # the rollout the latest checkpoint holds
        self.rollout_seconds = 0.0
        self.writer: MetricsWriter | None = None  # rank 0's metrics sinks, opened with the first report

    def samples(self, rollout_id: int, groups: GroupSource) -> list[Sample]:
        """This rank's share of rollout `rollout_id` (rank 0's from `groups`). A trainer told to stop while it
        waits saves the state after its last step first: that is the safe point to resume from."""
        start = time.monotonic()
        try:
            samples = self.rollouts.samples(rollout_id, groups)
        except (JobPreempted, RankAborted) as err:
            if self.driver.save and self.saved < rollout_id - 1 and preempted(err):
                self.save(rollout_id - 1)
            raise
        self.rollout_seconds = time.monotonic() - start
        return samples

    def train(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        """Train on this rank's share of rollout `rollout_id`; the rollout's and the steps' metrics. The reference
        model follows the policy every ref_update_interval rollouts."""
        if self.world.rank == 0 and self.deps.board is not None:  # the dashboard's copy of rank 0's share
            self.deps.board.record(self.driver.job_id, rollout_id, samples, self.driver.hf_checkpoint)
        start = time.monotonic()
        steps = self.backend.train_rollout(samples)
        metrics = {**self.rollouts.rollout_metrics(samples, rollout_id), **self.world.mean(mean_metrics(steps)),
                   "perf/rollout_seconds": self.rollout_seconds, "perf/train_seconds": time.monotonic() - start}
        interval = self.driver.ref_update_interval
        if interval and (rollout_id + 1) % interval == 0:
            self.backend.update_ref_model()
        return metrics

    def save_if_due(self, rollout_id: int, metrics: dict[str, float]) -> dict[str, float]:
        """A checkpoint of rollout `rollout_id` every save_interval rollouts and after the last, with the rollout's
        `metrics` so far kept beside it (a kill before their report loses none)."""
        driver = self.driver
        if not driver.save or not (rollout_id == driver.num_rollout - 1 or should_run_periodic_action(
                rollout_id, driver.save_interval, num_rollout=driver.num_rollout)):
            return {}
        start = time.monotonic()
        self.save(rollout_id, metrics={**metrics, "perf/save_seconds": 0.0})
        return {"perf/save_seconds": time.monotonic() - start}

    def save(self, rollout_id: int, metrics: dict[str, float] | None = None) -> None:
        iterations.save_checkpoint(self.driver.save, rollout_id, self.backend, self.world,
                                   functools.partial(self.trainer_state, rollout_id), metrics=metrics)
        self.saved = rollout_id

    def trainer_state(self, rollout_id: int) -> iterations.TrainerState:
        """Rank 0 (save_checkpoint calls it there): the driver's part of checkpoint `rollout_id`, with the buffer's
        snapshot (no rollout is running)."""
        driver = self.driver
        buffer = None if driver.train_only else self.deps.buffer.save_state(driver.job_id, rollout_id).to_dict()
        CHECKPOINTS.inc()
        return iterations.TrainerState(rollout_id=rollout_id, job_id=driver.job_id, world_size=self.world.world_size,
                                       buffer=buffer)

    def push_weights(self, rollout_id: int) -> dict[str, float]:
        """The weights after rollout `rollout_id` to the engines, as version rollout_id + 1."""
        return self.weights.push(self.backend, rollout_id + 1)

    def manager_metrics(self, rollout_id: int) -> dict[str, float]:
        """The manager's counters of rollout `rollout_id` the trainer cannot compute from samples."""
        if not self.driver.engines:
            return {}
        return self.world.on_rank0(post_rollout.manager_metrics, self.driver, self.deps, rollout_id)

    def evaluate_if_due(self, rollout_id: int) -> dict[str, float]:
        """eval/* with the weights pushed after rollout `rollout_id`, every eval_interval rollouts and after the
        last."""
        if not (self.driver.engines and post_rollout.eval_due(self.driver, self.rollout, rollout_id)):
            return {}
        return self.world.on_rank0(lambda: post_rollout.evaluate(self.driver, self.weights.rollout_config(self.rollout),
                                                                   self.deps, rollout_id))

    def report(self, rollout_id: int, metrics: dict[str, float]) -> None:
        """The rollout's metrics to the job's events, TensorBoard (and W&B) and the log."""
        self.world.on_rank0(self._report, rollout_id, metrics)

    def close(self) -> None:
        """Close the metrics sinks; never raises."""
        if self.writer is not None:
            self.writer.close()

    def _report(self, rollout_id: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            self.writer = metrics_writer(self.driver, self.deps, self.rollout.args)
        self.writer.write(rollout_id, metrics)
        self.ctx.report(rollout_id, metrics)
        log.info("job %s rollout %d: reward %.3f loss %.4f (rollout %.1f s, train %.1f s)", self.driver.job_id,
                 rollout_id, metrics["rollout/reward_mean"], metrics.get("train/loss", float("nan")),
                 metrics["perf/rollout_seconds"], metrics["perf/train_seconds"])


def weight_update_due(driver: DriverConfig, rollout_id: int) -> bool:
    """Whether the weights after rollout `rollout_id` go to the engines: after every rollout in sync mode; in the
    async modes every update_weights_interval rollouts and after the last. From the job's settings alone, so the
    same on every rank."""
    if not driver.engines:
        return False
    return driver.mode == "sync" or should_run_periodic_action(rollout_id, driver.update_weights_interval,
                                                               num_rollout=driver.num_rollout)


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for step in steps for k in step}
    return {k: statistics.fmean(step[k] for step in steps if k in step) for k in sorted(keys)}


def metrics_writer(driver: DriverConfig, deps: TrainerDeps, args: dict) -> MetricsWriter:
    """TensorBoard files (and a W&B run under use_wandb, logging the job's `args` as its config)."""
    tensorboard = Path(deps.tensorboard_dir) / driver.job_id if deps.tensorboard_dir else \
        Path(driver.save) / "tensorboard" if driver.save else None
    return MetricsWriter(tensorboard, wandb_log.start(driver, args), job_id=driver.job_id)
