"""The training driver (slime's train.py and train_async.py): rollout -> train -> checkpoint -> broadcast weights,
with the rollouts coming from `feed.RolloutFeed` in the job's mode (sync, one_step_async or fully_async).

Every trainer rank runs it (SPMD). Rank 0 alone talks to the buffer, the manager and the engines; it hands each
rollout to the other ranks, and each trains its share (`parallel.shard_rollout`). Rank-0-only work goes through
`world.on_rank0`, so a failure there ends the job on every rank instead of leaving them in a collective.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.buffer.client import BufferClient, DataSourceState
from services.common.errors import InvalidArgument
from services.common.samples import Sample, Status
from services.rollout.client import RolloutClient
from services.trainer import checkpoint
from services.trainer.feed import RolloutFeed, staleness_metrics
from services.trainer.generation import generation_metrics
from services.trainer.jobs import JobContext
from services.trainer.metrics import CHECKPOINTS, MetricsWriter
from services.trainer.parallel import World, shard_rollout
from services.trainer.spec import JobSpec
from services.trainer.train_config import train_config

log = logging.getLogger(__name__)

BACKENDS = {"fsdp": "services.trainer.backends.fsdp:TorchBackend",  # train_backend -> class
            "megatron": "services.trainer.backends.megatron.backend:MegatronBackend"}


@dataclass
class TrainerDeps:
    """What a job runs with: the peers (rank 0 only; None on the other ranks), the trainer's ranks, where rank 0
    hosts the weight-sync group, and where TensorBoard event files go."""

    buffer: BufferClient | None = None
    rollout: RolloutClient | None = None
    master_address: str = "127.0.0.1"
    num_threads: int = 2
    world: World = field(default_factory=World)
    tensorboard_dir: str = ""


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    rewards = [s.reward for s in samples]
    lengths = [s.response_length for s in samples]
    return {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/response_len_mean": statistics.fmean(lengths),
        "rollout/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        "rollout/reward_failed_ratio": sum(bool(s.reward_error) for s in samples) / len(samples),
    }


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for step in steps for k in step}
    return {k: statistics.fmean(step[k] for step in steps if k in step) for k in sorted(keys)}


def sync_weights(broadcaster, backend, deps: TrainerDeps, version: int) -> dict[str, float]:
    """Every rank: gather the full weights to rank 0 (FSDP), which pushes them to the manager's engines."""
    start = time.monotonic()
    weights = list(backend.named_weights())

    def push() -> dict[str, float]:
        from services.trainer.weight_sync import sync_engine_pool  # the pool names the engines (issue 5)

        stats = sync_engine_pool(broadcaster, deps.rollout, weights, str(version),
                                 base_model_dir=getattr(backend, "model_path", None))
        return {"perf/update_weights_seconds": time.monotonic() - start,
                "perf/update_weights_bytes": float(stats.get("bytes", 0)),
                "perf/engine_pause_seconds": float(stats.get("pause_seconds", 0.0))}

    return deps.world.on_rank0(push)


def make_backend(spec: JobSpec, world: World, num_threads: int):
    """The spec's train_backend on this rank. FSDP ranks each get a TrainConfig cut to their share of each step;
    Megatron takes whole steps and splits them over its data-parallel ranks itself."""
    module, name = BACKENDS[spec.train_backend].split(":")
    config = train_config(spec)
    cls = getattr(importlib.import_module(module), name)
    if spec.train_backend == "megatron":
        parallel = spec.tensor_model_parallel_size * spec.pipeline_model_parallel_size
        if world.world_size % parallel:
            raise InvalidArgument(f"train_backend megatron: {world.world_size} trainer ranks are not a multiple of "
                                  f"tensor_model_parallel_size × pipeline_model_parallel_size ({parallel})")
        return cls(spec.hf_checkpoint, config, tensor_model_parallel_size=spec.tensor_model_parallel_size,
                   pipeline_model_parallel_size=spec.pipeline_model_parallel_size,
                   use_distributed_optimizer=spec.use_distributed_optimizer, megatron_args=spec.megatron,
                   num_threads=num_threads, world=world)
    if world.distributed:
        if config.use_dynamic_batch_size:
            raise InvalidArgument("use_dynamic_batch_size is not supported with more than one trainer rank (ranks "
                                  "must run the same number of micro-batches)")
        local = config.global_batch_size and config.global_batch_size // world.world_size
        config = dataclasses.replace(config, global_batch_size=local)
    return cls(spec.hf_checkpoint, config, num_threads=num_threads, world=world)


def rank_samples(spec: JobSpec, world: World, samples: list[Sample]) -> list[Sample]:
    """What this rank trains on: its share of each step under FSDP, the whole rollout under Megatron."""
    if spec.train_backend == "megatron":
        return samples
    return shard_rollout(samples, rank=world.rank, world_size=world.world_size,
                         global_batch_size=spec.resolved_global_batch_size,
                         n_samples_per_prompt=spec.n_samples_per_prompt)


def resume(spec: JobSpec, backend, deps: TrainerDeps) -> int:
    """Load `ref_load` and `load` (restoring the buffer's state on rank 0); the first rollout id to run."""
    world = deps.world
    if spec.ref_load:
        checkpoint.load_reference(spec.ref_load, backend, world)
    if not spec.load:
        return 0
    state = checkpoint.load_checkpoint(spec.load, backend, world, spec.ckpt_step)
    if state is None:
        if (Path(spec.load) / "config.json").is_file():
            backend.load(spec.load)  # an HF directory: its weights, a fresh optimizer (slime's second case)
        else:
            log.info("job %s: %s holds no checkpoint yet; starting at rollout 0", spec.job_id, spec.load)
        return 0
    if state.buffer is not None and not spec.train_only:
        world.on_rank0(lambda: deps.buffer.restore_state(spec.job_id, DataSourceState.from_dict(state.buffer)))
    return state.rollout_id + 1


def load_dataset(spec: JobSpec, deps: TrainerDeps, ctx: JobContext) -> None:
    info = deps.buffer.load_dataset(spec.job_id, spec.prompt_data, input_key=spec.input_key,
                                    label_key=spec.label_key, metadata_key=spec.metadata_key,
                                    apply_chat_template=spec.apply_chat_template,
                                    rollout_shuffle=spec.rollout_shuffle, rollout_seed=spec.rollout_seed)
    if info.num_prompts == 0:
        raise InvalidArgument(f"prompt_data {spec.prompt_data}: no usable prompts ({'; '.join(info.errors)})")
    ctx.report(-1, {}, f"dataset: {info.num_prompts} prompts, {info.num_skipped} rows skipped")


def metrics_writer(spec: JobSpec, deps: TrainerDeps) -> MetricsWriter:
    if deps.tensorboard_dir:
        return MetricsWriter(Path(deps.tensorboard_dir) / spec.job_id, job_id=spec.job_id)
    return MetricsWriter(Path(spec.save) / "tensorboard" if spec.save else None, job_id=spec.job_id)


def rollout_only(spec: JobSpec, ctx: JobContext, deps: TrainerDeps) -> None:
    """debug_rollout_only (rank 0): generate (and dump) rollouts with the engines' weights; train nothing."""
    load_dataset(spec, deps, ctx)
    writer = metrics_writer(spec, deps)
    feed = RolloutFeed(spec, deps, ctx)
    try:
        for rollout_id in range(spec.num_rollout):
            metrics = rollout_metrics(feed.samples(rollout_id, rollout_id))
            writer.write(rollout_id, metrics)
            ctx.report(rollout_id, metrics)
    finally:
        writer.close()


def train(spec: JobSpec, ctx: JobContext | None, deps: TrainerDeps) -> None:
    """Run a job on this rank in the spec's mode; `ctx` is rank 0's (None on the other ranks)."""
    from services.trainer.weight_sync import WeightBroadcaster

    world = deps.world
    lead, engines = world.rank == 0, not spec.train_only
    if spec.debug_rollout_only:
        if lead:
            rollout_only(spec, ctx, deps)
        return
    if engines:
        world.on_rank0(lambda: load_dataset(spec, deps, ctx))
    backend = make_backend(spec, world, deps.num_threads)
    start_id = resume(spec, backend, deps)
    broadcaster = WeightBroadcaster([], master_address=deps.master_address, backend=spec.weight_sync_backend,
                                    timeout_s=spec.weight_sync_timeout_s,
                                    bucket_bytes=spec.update_weight_buffer_size) if lead and engines else None
    writer = metrics_writer(spec, deps) if lead else None
    feed = RolloutFeed(spec, deps, ctx) if lead else None
    if start_id:
        world.on_rank0(lambda: ctx.report(start_id - 1, {}, f"resumed from {spec.load} at rollout {start_id}"))
    try:
        if engines:  # like slime, push the trainer's weights first: engines may hold another job's
            sync_weights(broadcaster, backend, deps, version=start_id)
        engine_version = start_id  # what the engines hold; the trainer's weights are version rollout_id
        for rollout_id in range(start_id, spec.num_rollout):
            start = time.monotonic()
            samples = world.on_rank0(lambda: feed.samples(rollout_id, engine_version))  # noqa: B023
            rollout_s = time.monotonic() - start
            world.on_rank0(lambda: feed.started(rollout_id, engine_version))  # noqa: B023
            start = time.monotonic()
            steps = backend.train_rollout(rank_samples(spec, world, samples))
            metrics = {**rollout_metrics(samples), **staleness_metrics(samples, rollout_id),
                       **world.mean(mean_metrics(steps)),
                       "perf/rollout_seconds": rollout_s, "perf/train_seconds": time.monotonic() - start}
            if spec.ref_update_interval and (rollout_id + 1) % spec.ref_update_interval == 0:
                backend.update_ref_model()
            if spec.save and (rollout_id == spec.num_rollout - 1 or checkpoint.should_run_periodic_action(
                    rollout_id, spec.save_interval, num_rollout=spec.num_rollout)):
                start = time.monotonic()
                checkpoint.save_checkpoint(spec.save, rollout_id, backend, world,
                                           lambda: trainer_state(spec, deps, rollout_id))  # noqa: B023
                metrics["perf/save_seconds"] = time.monotonic() - start
            if engines and weight_update_due(spec, rollout_id):
                if spec.mode == "one_step_async":
                    start = time.monotonic()
                    world.on_rank0(lambda: feed.before_weight_update(rollout_id, engine_version))  # noqa: B023
                    metrics["perf/wait_next_rollout_seconds"] = time.monotonic() - start
                metrics.update(sync_weights(broadcaster, backend, deps, version=rollout_id + 1))
                engine_version = rollout_id + 1
            if engines:  # -- generation features (issue 5): dynamic-filter counters, and eval when due --
                metrics.update(world.on_rank0(lambda: generation_metrics(spec, deps, rollout_id)))  # noqa: B023
                metrics.update(world.on_rank0(lambda: feed.metrics()))
            world.on_rank0(lambda: report(spec, ctx, writer, rollout_id, metrics))  # noqa: B023
        if spec.save_hf:
            backend.save_hf(spec.save_hf.format(rollout_id=spec.num_rollout - 1))
    finally:
        if feed is not None:
            feed.close()
        if broadcaster is not None:
            broadcaster.close()
        if writer is not None:
            writer.close()


def weight_update_due(spec: JobSpec, rollout_id: int) -> bool:
    """sync pushes after every rollout; the async modes every update_weights_interval rollouts and after the last."""
    if spec.mode == "sync":
        return True
    return (rollout_id + 1) % spec.update_weights_interval == 0 or rollout_id == spec.num_rollout - 1


def trainer_state(spec: JobSpec, deps: TrainerDeps, rollout_id: int) -> checkpoint.TrainerState:
    """Rank 0: the driver's part of checkpoint `rollout_id`, with the buffer's snapshot (no rollout is running)."""
    buffer = None if spec.train_only else deps.buffer.save_state(spec.job_id, rollout_id).to_dict()
    CHECKPOINTS.inc()
    return checkpoint.TrainerState(rollout_id=rollout_id, job_id=spec.job_id, world_size=deps.world.world_size,
                                   buffer=buffer)


def report(spec: JobSpec, ctx: JobContext, writer: MetricsWriter, rollout_id: int, metrics: dict[str, float]) -> None:
    writer.write(rollout_id, metrics)
    ctx.report(rollout_id, metrics)
    log.info("job %s rollout %d: reward %.3f loss %.4f (rollout %.1f s, train %.1f s)", spec.job_id, rollout_id,
             metrics["rollout/reward_mean"], metrics.get("train/loss", float("nan")), metrics["perf/rollout_seconds"],
             metrics["perf/train_seconds"])
