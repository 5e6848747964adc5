"""The training driver (slime's train.py and train_async.py): rollout -> train -> checkpoint -> push weights, with
the rollouts coming from the feed of the job's mode (`feed.make_feed`: sync, one_step_async or fully_async).

Every trainer rank runs it (SPMD) and reads its own share of each rollout (`TrainBackend.rollout_share`). All that
rank 0 alone does (the rollout manager, the buffer's state, the job's events) is the feed's; the weights the engines
hold are `sync.versions.EngineWeights`'.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from pathlib import Path

from services.common import write_roots
from services.common.errors import InvalidArgument
from services.common.settings.rollout import RolloutConfig
from services.trainer.backends import fsdp, megatron  # noqa: F401 - each registers its builder
from services.trainer.backends.base import TrainBackend
from services.trainer.backends.capabilities import capabilities
from services.trainer.backends.registry import build_backend
from services.trainer.checkpoint import iterations
from services.trainer.distributed.parallel import RankAborted, World
from services.trainer.driver import slime_checkpoint_conversion
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.feed import RolloutFeed, combine_rollout_stats, make_feed, metrics_writer, rollout_sums
from services.trainer.driver.intervals import should_run_periodic_action
from services.trainer.driver.job import JobControl, JobParts, JobPreempted, preempted
from services.trainer.driver.sample_board import BOARD
from services.trainer.settings.driver import DriverConfig
from services.trainer.settings.weight_sync import SyncConfig
from services.trainer.weight_sync.versions import EngineWeights

log = logging.getLogger(__name__)

__all__ = ["TrainerDeps", "make_backend", "train"]


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for step in steps for k in step}
    return {k: statistics.fmean(step[k] for step in steps if k in step) for k in sorted(keys)}


def resume(driver: DriverConfig, backend: TrainBackend, feed: RolloutFeed, world: World) -> int:
    """Load `ref_load`, `opd_teacher_load` and `load` (the feed puts the buffer's data source back); the first
    rollout id to run."""
    if driver.ref_load:
        iterations.load_reference(driver.ref_load, backend, world, driver.ref_ckpt_step)
    if driver.opd_teacher_load:
        iterations.load_teacher(driver.opd_teacher_load, backend, world, driver.opd_teacher_ckpt_step)
    if not driver.load:
        return 0
    if (slime := iterations.slime_checkpoint(driver.load, driver.ckpt_step)) is not None:
        # slime's finetune case: the weights, a fresh optimizer; Megatron-LM's optimizer and data state stay unread
        backend.load_megatron_checkpoint(slime, "model")
        log.info("job %s: policy weights from slime's checkpoint %s; starting at rollout 0", driver.job_id, slime)
        return 0
    state = iterations.load_checkpoint(driver.load, backend, world, driver.ckpt_step)
    if state is None:
        if (Path(driver.load) / "config.json").is_file():
            backend.load(driver.load)  # an HF directory: its weights, a fresh optimizer (slime's second case)
        else:
            log.info("job %s: %s holds no checkpoint yet; starting at rollout 0", driver.job_id, driver.load)
        return 0
    # this job's own checkpoint (it was stopped): the rollout's metrics, in case the stop came before their report
    metrics = iterations.saved_metrics(driver.load, state.rollout_id) if state.job_id == driver.job_id else None
    feed.resumed(state.rollout_id + 1, state.buffer, metrics)
    return state.rollout_id + 1


def load_dataset(driver: DriverConfig, rollout: RolloutConfig, deps: TrainerDeps, ctx: JobControl) -> None:
    info = deps.buffer.load_dataset(driver.job_id, driver.prompt_data, input_key=rollout.input_key,
                                    label_key=rollout.label_key, metadata_key=rollout.metadata_key,
                                    apply_chat_template=rollout.apply_chat_template,
                                    rollout_shuffle=driver.rollout_shuffle, rollout_seed=driver.rollout_seed,
                                    multimodal_keys=rollout.multimodal_keys)
    if info.num_prompts == 0:
        raise InvalidArgument(f"prompt_data {driver.prompt_data}: no usable prompts ({'; '.join(info.errors)})")
    ctx.report(-1, {}, f"dataset: {info.num_prompts} prompts, {info.num_skipped} rows skipped")


def rollout_only(driver: DriverConfig, rollout: RolloutConfig, ctx: JobControl, deps: TrainerDeps) -> None:
    """debug_rollout_only (rank 0 alone): generate (and dump) rollouts with the engines' weights; train nothing."""
    load_dataset(driver, rollout, deps, ctx)
    writer = metrics_writer(driver, deps, rollout.args)
    feed = make_feed(driver, rollout, deps, ctx)
    try:
        for rollout_id in range(driver.num_rollout):
            samples = feed.rollout(rollout_id, feed.share)
            BOARD.record(driver.job_id, rollout_id, samples, driver.hf_checkpoint)
            metrics = combine_rollout_stats([rollout_sums(samples, rollout_id)])
            writer.write(rollout_id, metrics)
            ctx.report(rollout_id, metrics)
    finally:
        writer.close()


def make_backend(spec: JobParts, world: World, num_threads: int) -> TrainBackend:
    """The spec's train_backend on this rank, built from the spec's training settings and layout."""
    return build_backend(spec.hf_checkpoint, spec.train, spec.layout, world, num_threads)


def train(spec: JobParts, ctx: JobControl | None, deps: TrainerDeps) -> None:
    """Run a job on this rank in the spec's mode; `ctx` is rank 0's (None on the other ranks). The spec is cut
    into its parts here, once: the loop reads the driver's settings, each part gets its own config."""
    driver, rollout = spec.driver, spec.rollout
    if driver.debug_rollout_only:
        if deps.world.rank == 0:
            rollout_only(driver, rollout, ctx, deps)
        return
    if driver.engines:
        deps.world.on_rank0(load_dataset, driver, rollout, deps, ctx)
    if not capabilities(spec.layout.train_backend).slime_checkpoints:  # before the backend takes the memory
        driver = slime_checkpoint_conversion.converted_paths(driver, deps.world)
    backend = make_backend(spec, deps.world, deps.num_threads)
    run(driver, rollout, spec.sync, backend, ctx, deps)


def run(driver: DriverConfig, rollout: RolloutConfig, sync: SyncConfig, backend: TrainBackend,
        ctx: JobControl | None, deps: TrainerDeps) -> None:
    """The rollout -> train -> checkpoint -> weights loop of every mode; the feed is where the modes differ."""
    world, last = deps.world, driver.num_rollout - 1
    weights = EngineWeights(world, deps.rollout, engines=driver.engines, sync=sync,
                            master_address=deps.master_address, model_dir=driver.hf_checkpoint, job_id=driver.job_id)
    feed = make_feed(driver, rollout, deps, ctx, weights, backend.rollout_share())
    try:
        start_id = resume(driver, backend, feed, world)
        weights.version = start_id
        if driver.engines:  # like slime, push the trainer's weights first: engines may hold another job's
            weights.push(backend, start_id)
        saved = start_id - 1  # the rollout the latest checkpoint holds (start_id - 1: the loaded one)
        for rollout_id in range(start_id, driver.num_rollout):
            start = time.monotonic()
            try:
                samples = feed.samples(rollout_id)
            except (JobPreempted, RankAborted) as err:  # SIGTERM: the state after the last step is the safe point
                if driver.save and saved < rollout_id - 1 and preempted(err):
                    iterations.save_checkpoint(driver.save, rollout_id - 1, backend, world,
                                                functools.partial(feed.trainer_state, rollout_id - 1))
                raise
            rollout_s = time.monotonic() - start
            feed.started(rollout_id)
            if world.rank == 0:  # the dashboard's copy of rank 0's share; recording never raises
                BOARD.record(driver.job_id, rollout_id, samples, driver.hf_checkpoint)
            start = time.monotonic()
            steps = backend.train_rollout(samples)
            metrics = {**feed.rollout_metrics(samples, rollout_id), **world.mean(mean_metrics(steps)),
                       "perf/rollout_seconds": rollout_s, "perf/train_seconds": time.monotonic() - start}
            if driver.ref_update_interval and (rollout_id + 1) % driver.ref_update_interval == 0:
                backend.update_ref_model()
            if driver.save and (rollout_id == last or should_run_periodic_action(
                    rollout_id, driver.save_interval, num_rollout=driver.num_rollout)):
                start = time.monotonic()
                iterations.save_checkpoint(driver.save, rollout_id, backend, world,
                                            functools.partial(feed.trainer_state, rollout_id),
                                            metrics={**metrics, "perf/save_seconds": 0.0})  # kept with it
                metrics["perf/save_seconds"] = time.monotonic() - start
                saved = rollout_id
            if feed.weight_update_due(rollout_id):
                metrics.update(feed.before_weight_update(rollout_id))
                metrics.update(weights.push(backend, rollout_id + 1))
            metrics.update(feed.after_rollout(rollout_id))  # the manager's counters, and eval when due
            feed.report(rollout_id, metrics)
        if driver.save_hf:
            backend.save_hf(write_roots.writable_dir(driver.save_hf.format(rollout_id=last), write_roots.EXPORTS,
                                                     "save_hf"))
    finally:
        feed.close()
        weights.close()
