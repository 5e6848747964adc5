"""The training driver (slime's train.py and train_async.py): rollout -> train -> checkpoint -> broadcast weights,
with the rollouts coming from the feed of the job's mode (`feed.make_feed`: sync, one_step_async or fully_async).

Every trainer rank runs it (SPMD). Rank 0 alone talks to the buffer, the manager and the engines; it hands each
rollout to the other ranks, and each trains its share (`TrainBackend.rank_samples`). Rank-0-only work goes through
`world.on_rank0`, so a failure there ends the job on every rank instead of leaving them in a collective.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

from services.buffer.client import DataSourceState
from services.common.errors import InvalidArgument
from services.common.rollout_stats import RolloutStats
from services.common.samples import Sample
from services.rollout.client import RolloutConfig
from services.trainer.backends import fsdp, megatron  # noqa: F401 - each registers its builder
from services.trainer.backends.base import TrainBackend
from services.trainer.backends.registry import build_backend
from services.trainer.driver import checkpoint, wandb_log
from services.trainer.driver.config import DriverConfig
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.feed import make_feed, staleness_metrics
from services.trainer.driver.intervals import should_run_periodic_action
from services.trainer.driver.metrics import CHECKPOINTS, MetricsWriter
from services.trainer.driver.post_rollout import generation_metrics
from services.trainer.jobs import JobContext, JobPreempted, preempted
from services.trainer.parallel import RankAborted, World
from services.trainer.spec import JobSpec
from services.trainer.sync.config import SyncConfig

log = logging.getLogger(__name__)

__all__ = ["TrainerDeps", "make_backend", "train"]


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    """The manager's rollout/* means, plus the reward spread and the share of failed rewards."""
    return {**RolloutStats.of(samples).metrics(), "rollout/reward_std": statistics.pstdev(s.reward for s in samples),
            "rollout/reward_failed_ratio": sum(bool(s.reward_error) for s in samples) / len(samples)}


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for step in steps for k in step}
    return {k: statistics.fmean(step[k] for step in steps if k in step) for k in sorted(keys)}


def sync_weights(broadcaster, backend: TrainBackend, deps: TrainerDeps, version: int) -> dict[str, float]:
    """Every rank: gather the full weights to rank 0 (FSDP), which pushes them to the manager's engines."""
    start = time.monotonic()
    weights = list(backend.named_weights())

    def push() -> dict[str, float]:
        from services.trainer.sync.weight_sync import sync_engine_pool

        stats = sync_engine_pool(broadcaster, deps.rollout, weights, str(version), base_model_dir=backend.model_path)
        return {"perf/update_weights_seconds": time.monotonic() - start,
                "perf/update_weights_bytes": float(stats.get("bytes", 0)),
                "perf/engine_pause_seconds": float(stats.get("pause_seconds", 0.0))}

    return deps.world.on_rank0(push)


def resume(driver: DriverConfig, backend: TrainBackend, deps: TrainerDeps) -> int:
    """Load `ref_load` and `load` (restoring the buffer's state on rank 0); the first rollout id to run."""
    world = deps.world
    if driver.ref_load:
        checkpoint.load_reference(driver.ref_load, backend, world)
    if not driver.load:
        return 0
    state = checkpoint.load_checkpoint(driver.load, backend, world, driver.ckpt_step)
    if state is None:
        if (Path(driver.load) / "config.json").is_file():
            backend.load(driver.load)  # an HF directory: its weights, a fresh optimizer (slime's second case)
        else:
            log.info("job %s: %s holds no checkpoint yet; starting at rollout 0", driver.job_id, driver.load)
        return 0
    if state.buffer is not None and driver.engines:
        world.on_rank0(lambda: deps.buffer.restore_state(driver.job_id, DataSourceState.from_dict(state.buffer)))
    return state.rollout_id + 1


def load_dataset(driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, ctx: JobContext) -> None:
    info = deps.buffer.load_dataset(driver.job_id, driver.prompt_data, input_key=rollout.input_key,
                                    label_key=rollout.label_key, metadata_key=rollout.metadata_key,
                                    apply_chat_template=rollout.apply_chat_template,
                                    rollout_shuffle=driver.rollout_shuffle, rollout_seed=driver.rollout_seed)
    if info.num_prompts == 0:
        raise InvalidArgument(f"prompt_data {driver.prompt_data}: no usable prompts ({'; '.join(info.errors)})")
    ctx.report(-1, {}, f"dataset: {info.num_prompts} prompts, {info.num_skipped} rows skipped")


def metrics_writer(driver: DriverConfig, deps: TrainerDeps, args: dict) -> MetricsWriter:
    """TensorBoard files (and a W&B run under use_wandb, logging the job's `args` as its config)."""
    tensorboard = Path(deps.tensorboard_dir) / driver.job_id if deps.tensorboard_dir else \
        Path(driver.save) / "tensorboard" if driver.save else None
    return MetricsWriter(tensorboard, wandb_log.start(driver, args), job_id=driver.job_id)


def rollout_only(driver: DriverConfig, rollout: RolloutConfig, ctx: JobContext, deps: TrainerDeps) -> None:
    """debug_rollout_only (rank 0): generate (and dump) rollouts with the engines' weights; train nothing."""
    load_dataset(driver, rollout, deps, ctx)
    writer = metrics_writer(driver, deps, rollout.args)
    feed = make_feed(driver, rollout, deps, ctx)
    try:
        for rollout_id in range(driver.num_rollout):
            metrics = rollout_metrics(feed.samples(rollout_id, rollout_id))
            writer.write(rollout_id, metrics)
            ctx.report(rollout_id, metrics)
    finally:
        writer.close()


def make_backend(spec: JobSpec, world: World, num_threads: int) -> TrainBackend:
    """The spec's train_backend on this rank, built from the spec's training settings and layout."""
    return build_backend(spec.hf_checkpoint, spec.train, spec.layout, world, num_threads)


def train(spec: JobSpec, ctx: JobContext | None, deps: TrainerDeps) -> None:
    """Run a job on this rank in the spec's mode; `ctx` is rank 0's (None on the other ranks). The spec is cut
    into its parts here, once: the loop reads the driver's settings, each part gets its own config."""
    driver, rollout = spec.driver, spec.rollout
    if driver.debug_rollout_only:
        if deps.world.rank == 0:
            rollout_only(driver, rollout, ctx, deps)
        return
    if driver.engines:
        deps.world.on_rank0(lambda: load_dataset(driver, rollout, deps, ctx))
    backend = make_backend(spec, deps.world, deps.num_threads)
    run(driver, rollout, spec.sync, backend, ctx, deps)


def run(driver: DriverConfig, rollout: RolloutConfig, sync: SyncConfig, backend: TrainBackend,
        ctx: JobContext | None, deps: TrainerDeps) -> None:
    """The rollout -> train -> checkpoint -> weights loop of every mode; the feed is where the modes differ."""
    from services.trainer.sync.auto import make_broadcaster

    world = deps.world
    lead, engines, last = world.rank == 0, driver.engines, driver.num_rollout - 1
    start_id = resume(driver, backend, deps)
    broadcaster = make_broadcaster(sync.weight_sync_backend, [], master_address=deps.master_address,
                                   timeout_s=sync.weight_sync_timeout_s, bucket_bytes=sync.update_weight_buffer_size,
                                   model_dir=driver.hf_checkpoint) if lead and engines else None
    writer = metrics_writer(driver, deps, rollout.args) if lead else None
    feed = make_feed(driver, rollout, deps, ctx) if lead else None
    if start_id:
        world.on_rank0(lambda: ctx.report(start_id - 1, {}, f"resumed from {driver.load} at rollout {start_id}"))
    try:
        if engines:  # like slime, push the trainer's weights first: engines may hold another job's
            sync_weights(broadcaster, backend, deps, version=start_id)
        engine_version = start_id  # what the engines hold; the trainer's weights are version rollout_id
        saved = start_id - 1  # the rollout the latest checkpoint holds (start_id - 1: the loaded one)
        for rollout_id in range(start_id, driver.num_rollout):
            start = time.monotonic()
            try:
                samples = world.on_rank0(lambda: feed.samples(rollout_id, engine_version))  # noqa: B023
            except (JobPreempted, RankAborted) as err:  # SIGTERM: the state after the last step is the safe point
                if driver.save and saved < rollout_id - 1 and preempted(err):
                    checkpoint.save_checkpoint(driver.save, rollout_id - 1, backend, world,
                                               lambda: trainer_state(driver, deps, rollout_id - 1))  # noqa: B023
                raise
            rollout_s = time.monotonic() - start
            world.on_rank0(lambda: feed.started(rollout_id, engine_version))  # noqa: B023
            start = time.monotonic()
            steps = backend.train_rollout(backend.rank_samples(samples))
            metrics = {**rollout_metrics(samples), **staleness_metrics(samples, rollout_id),
                       **world.mean(mean_metrics(steps)),
                       "perf/rollout_seconds": rollout_s, "perf/train_seconds": time.monotonic() - start}
            if driver.ref_update_interval and (rollout_id + 1) % driver.ref_update_interval == 0:
                backend.update_ref_model()
            if driver.save and (rollout_id == last or should_run_periodic_action(
                    rollout_id, driver.save_interval, num_rollout=driver.num_rollout)):
                start = time.monotonic()
                checkpoint.save_checkpoint(driver.save, rollout_id, backend, world,
                                           lambda: trainer_state(driver, deps, rollout_id))  # noqa: B023
                metrics["perf/save_seconds"] = time.monotonic() - start
                saved = rollout_id
            if engines and world.on_rank0(lambda: feed.weight_update_due(rollout_id)):  # noqa: B023
                metrics.update(world.on_rank0(lambda: feed.before_weight_update(rollout_id, engine_version)))  # noqa: B023
                metrics.update(sync_weights(broadcaster, backend, deps, version=rollout_id + 1))
                engine_version = rollout_id + 1
            if engines:  # the manager's counters, and eval when due
                metrics.update(world.on_rank0(lambda: generation_metrics(driver, rollout, deps, rollout_id)))  # noqa: B023
                metrics.update(world.on_rank0(lambda: feed.metrics()))
            world.on_rank0(lambda: report(driver, ctx, writer, rollout_id, metrics))  # noqa: B023
        if driver.save_hf:
            backend.save_hf(driver.save_hf.format(rollout_id=last))
    finally:
        if feed is not None:
            feed.close()
        if broadcaster is not None:
            broadcaster.close()
        if writer is not None:
            writer.close()


def trainer_state(driver: DriverConfig, deps: TrainerDeps, rollout_id: int) -> checkpoint.TrainerState:
    """Rank 0: the driver's part of checkpoint `rollout_id`, with the buffer's snapshot (no rollout is running)."""
    buffer = None if driver.train_only else deps.buffer.save_state(driver.job_id, rollout_id).to_dict()
    CHECKPOINTS.inc()
    return checkpoint.TrainerState(rollout_id=rollout_id, job_id=driver.job_id, world_size=deps.world.world_size,
                                   buffer=buffer)


def report(driver: DriverConfig, ctx: JobContext, writer: MetricsWriter, rollout_id: int,
           metrics: dict[str, float]) -> None:
    writer.write(rollout_id, metrics)
    ctx.report(rollout_id, metrics)
    log.info("job %s rollout %d: reward %.3f loss %.4f (rollout %.1f s, train %.1f s)", driver.job_id, rollout_id,
             metrics["rollout/reward_mean"], metrics.get("train/loss", float("nan")), metrics["perf/rollout_seconds"],
             metrics["perf/train_seconds"])
