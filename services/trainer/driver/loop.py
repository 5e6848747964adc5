"""The training driver (slime's train.py and train_async.py): each mode is one short function, read top to bottom,
over the steps of a rollout every mode takes (`job_run.JobRun`) and the two ways of getting a rollout
(`rollouts.Rollouts`: `collect` one the manager runs by its id, or `take` from its stream).

- sync (slime's train.py): rollout i is generated after the weights of rollout i-1 reached the engines.
- one_step_async (slime's train_async.py): rollout i+1 starts before rollout i trains; before a weight update the
  trainer waits for it, so each rollout comes from one policy, one version behind.
- fully_async: the manager streams groups across rollouts (rollout -2 in the buffer, max_inflight_groups bound);
  rollout i takes the first finished groups whose oldest token is at most max_weight_staleness versions behind the
  trainer's weights (buffer TakeBatch; staler ones are regenerated or dropped and counted).

Every trainer rank runs it (SPMD) and reads its own share of each rollout (`TrainBackend.rollout_share`); what rank 0
alone does runs through `world.on_rank0`. The weights the engines hold are `weight_sync.versions.EngineWeights`'.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

from services.common import write_roots
from services.common.errors import InvalidArgument
from services.common.samples import SampleGroup
from services.common.settings.rollout import RolloutConfig
from services.common.shares import Share
from services.trainer.backends.base import TrainBackend
from services.trainer.backends.capabilities import capabilities
from services.trainer.backends.registry import build_backend
from services.trainer.checkpoint import iterations
from services.trainer.distributed.parallel import World
from services.trainer.driver import slime_checkpoint_conversion
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.job import JobControl, JobParts, shared_base_key
from services.trainer.driver.job_run import JobRun, metrics_writer, weight_update_due
from services.trainer.driver.rollouts import Rollouts, combine_rollout_stats, rollout_sums
from services.trainer.lora.shared_base import SharedBase
from services.trainer.settings.driver import DriverConfig
from services.trainer.settings.weight_sync import SyncConfig
from services.trainer.weight_sync.versions import EngineWeights

log = logging.getLogger(__name__)

__all__ = ["TrainerDeps", "make_backend", "train"]


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
    if spec.train.lora_share_pool:  # beside the other LoRA jobs of its base: the base held once, its adapter its own
        key = shared_base_key(spec)
        backend, base = deps.shared_bases.attach(key, driver.job_id, functools.partial(
            make_backend, spec, deps.world, deps.num_threads))
        try:
            run(driver, rollout, spec.sync, backend, ctx, deps, shared=base)
        finally:
            deps.shared_bases.detach(key, driver.job_id)
        return
    backend = make_backend(spec, deps.world, deps.num_threads)
    run(driver, rollout, spec.sync, backend, ctx, deps)


def run(driver: DriverConfig, rollout: RolloutConfig, sync_config: SyncConfig, backend: TrainBackend,
        ctx: JobControl | None, deps: TrainerDeps, shared: SharedBase | None = None) -> None:
    """A job on this rank with its backend built: resume, push the trainer's weights, the mode's driver, the final
    HF export. `shared`: the base the job shares with other LoRA jobs, and so what the engines hold of it."""
    world = deps.world
    weights = EngineWeights(world, deps.rollout, engines=driver.engines, sync=sync_config,
                            master_address=deps.master_address, model_dir=driver.hf_checkpoint, job_id=driver.job_id,
                            base_pushed=shared and shared.base_pushed, sync_lock=shared and shared.sync_lock,
                            lora=bool(backend.config.lora))
    rollouts = Rollouts(driver, rollout, deps, ctx, weights, backend.rollout_share())
    job = JobRun(driver, rollout, backend, weights, rollouts, ctx, deps)
    try:
        start_id = resume(driver, backend, rollouts, world)
        job.saved = start_id - 1  # the rollout the latest checkpoint holds (the loaded one)
        weights.version = start_id
        if driver.engines:  # like slime, push the trainer's weights first: engines may hold another job's
            weights.push(backend, start_id)
        MODES[driver.mode](job, start_id)
        if driver.save_hf:
            backend.save_hf(write_roots.writable_dir(driver.save_hf.format(rollout_id=driver.num_rollout - 1),
                                                     write_roots.EXPORTS, "save_hf"))
    finally:
        job.close()
        weights.close()


def sync(job: JobRun, start_id: int) -> None:
    """Generate rollout i with the weights of rollout i-1, train on it, push the new weights."""
    driver, rollouts = job.driver, job.rollouts
    for rollout_id in range(start_id, driver.num_rollout):
        samples = job.samples(rollout_id, functools.partial(rollouts.collect, rollout_id))
        metrics = job.train(rollout_id, samples)
        metrics.update(job.save_if_due(rollout_id, metrics))
        if weight_update_due(driver, rollout_id):
            metrics.update(job.push_weights(rollout_id))
        metrics.update(job.manager_metrics(rollout_id))
        metrics.update(job.evaluate_if_due(rollout_id))
        job.report(rollout_id, metrics)


def one_step_async(job: JobRun, start_id: int) -> None:
    """Rollout i+1 generates while rollout i trains. Before a weight update the trainer waits for rollout i+1 to
    finish with the weights it started with (slime waits likewise), so each rollout comes from one policy."""
    driver, rollouts, world = job.driver, job.rollouts, job.world
    ready: dict[int, list[SampleGroup]] = {}  # rank 0: rollouts waited for before an update

    def ready_or_collect(rollout_id: int, share: Share) -> list[SampleGroup]:
        return ready.pop(rollout_id) if rollout_id in ready else rollouts.collect(rollout_id, share)

    def wait_for_next(rollout_id: int) -> dict[str, float]:
        start = time.monotonic()
        if rollout_id + 1 < driver.num_rollout:
            share = Share() if driver.save_debug_rollout_data else rollouts.share
            ready[rollout_id + 1] = rollouts.collect(rollout_id + 1, share)
        return {"perf/wait_next_rollout_seconds": time.monotonic() - start}

    for rollout_id in range(start_id, driver.num_rollout):
        samples = job.samples(rollout_id, functools.partial(ready_or_collect, rollout_id))
        if rollout_id + 1 < driver.num_rollout:
            world.on_rank0(rollouts.start, rollout_id + 1)  # generated while this one trains
        metrics = job.train(rollout_id, samples)
        metrics.update(job.save_if_due(rollout_id, metrics))
        if weight_update_due(driver, rollout_id):
            metrics.update(world.on_rank0(wait_for_next, rollout_id))
            metrics.update(job.push_weights(rollout_id))
        metrics.update(job.manager_metrics(rollout_id))
        metrics.update(job.evaluate_if_due(rollout_id))
        job.report(rollout_id, metrics)


def fully_async(job: JobRun, start_id: int) -> None:
    """Take each rollout from the manager's stream, within the staleness bound; the stream runs on while the
    trainer trains, and ends with the job."""
    driver, rollouts, world = job.driver, job.rollouts, job.world
    try:
        for rollout_id in range(start_id, driver.num_rollout):
            samples = job.samples(rollout_id, functools.partial(rollouts.take, rollout_id))
            metrics = job.train(rollout_id, samples)
            metrics.update(job.save_if_due(rollout_id, metrics))
            if weight_update_due(driver, rollout_id):
                metrics.update(job.push_weights(rollout_id))
            metrics.update(job.manager_metrics(rollout_id))
            metrics.update(job.evaluate_if_due(rollout_id))
            if driver.engines:
                metrics.update(world.on_rank0(lambda: dict(rollouts.stale)))  # the take's too-stale groups
            job.report(rollout_id, metrics)
    finally:
        if world.rank == 0:
            rollouts.stop_stream()


MODES = {"sync": sync, "one_step_async": one_step_async, "fully_async": fully_async}


def resume(driver: DriverConfig, backend: TrainBackend, rollouts: Rollouts, world: World) -> int:
    """Load `ref_load`, `opd_teacher_load` and `load` (and put the buffer's data source back); the first
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
    world.on_rank0(rollouts.resumed, state.rollout_id + 1, state.buffer, metrics)
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
    rollouts = Rollouts(driver, rollout, deps, ctx)
    groups = rollouts.take if driver.mode == "fully_async" else rollouts.collect
    try:
        for rollout_id in range(driver.num_rollout):
            samples = rollouts.rollout(rollout_id, functools.partial(groups, rollout_id))
            if deps.board is not None:
                deps.board.record(driver.job_id, rollout_id, samples, driver.hf_checkpoint)
            metrics = combine_rollout_stats([rollout_sums(samples, rollout_id)])
            writer.write(rollout_id, metrics)
            ctx.report(rollout_id, metrics)
    finally:
        writer.close()


def make_backend(spec: JobParts, world: World, num_threads: int, base_model=None) -> TrainBackend:
    """The spec's train_backend on this rank, built from the spec's training settings and layout (on `base_model`,
    a shared base already loaded, when given)."""
    return build_backend(spec.hf_checkpoint, spec.train, spec.layout, world, num_threads, base_model=base_model)
