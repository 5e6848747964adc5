"""The synchronous training driver (slime's train.py): rollout -> train -> broadcast weights, per rollout id.

A plain function over clients and a backend; the job registry runs it on its worker thread.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from services.buffer.client import BufferClient
from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.common.samples import Sample, SampleGroup, Status
from services.rollout.client import RolloutClient, RolloutState
from services.trainer.jobs import JobContext
from services.trainer.spec import JobSpec
from services.trainer.train_config import rollout_config, train_config

log = logging.getLogger(__name__)

POLL_S = 2.0


@dataclass
class TrainerDeps:
    """The peers a job talks to, and where the trainer's rank 0 hosts the weight-sync group."""

    buffer: BufferClient
    rollout: RolloutClient
    master_address: str = "127.0.0.1"
    num_threads: int = 2


def collect_rollout(spec: JobSpec, deps: TrainerDeps, rollout_id: int, weight_version: str,
                    ctx: JobContext) -> list[SampleGroup]:
    """Ask the manager for rollout `rollout_id` and wait for its groups in the buffer.

    Starting a rollout is idempotent; a manager that restarted reports it UNKNOWN and is asked again, and the
    buffer's leases make sure no prompt is lost or trained twice.
    """
    config = rollout_config(spec)
    deps.rollout.start_rollout(config, rollout_id, weight_version)
    deadline = time.monotonic() + spec.rollout_timeout_s
    while True:
        ctx.check_cancelled()
        try:
            return deps.buffer.get_batch(spec.job_id, rollout_id, spec.rollout_batch_size, timeout_s=POLL_S)
        except (DeadlineExceeded, Unavailable) as err:
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"rollout {rollout_id} of job {spec.job_id}: not complete after "
                                       f"{spec.rollout_timeout_s} s ({err})") from err
        try:
            status = deps.rollout.rollout_status(spec.job_id, rollout_id)
        except Unavailable as err:
            log.warning("rollout manager unavailable (%s); waiting", err)
            continue
        if status.state == RolloutState.FAILED:
            raise RuntimeError(f"rollout {rollout_id} of job {spec.job_id} failed: {status.error}")
        if status.state == RolloutState.UNKNOWN:
            log.warning("rollout manager does not know rollout %d (restarted?); starting it again", rollout_id)
            deps.rollout.start_rollout(config, rollout_id, weight_version)


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
    """Push the backend's weights to every engine the manager lists, as `version`."""
    engines, _ = deps.rollout.list_engines()
    broadcaster.set_engines([e.url for e in engines])
    start = time.monotonic()
    stats = broadcaster.broadcast(backend.named_weights(), str(version))
    return {"perf/update_weights_seconds": time.monotonic() - start,
            "perf/update_weights_bytes": float(stats.get("bytes", 0))}


def train_sync(spec: JobSpec, ctx: JobContext, deps: TrainerDeps) -> None:
    from services.trainer.backends.fsdp import TorchBackend
    from services.trainer.weight_sync import WeightBroadcaster

    info = deps.buffer.load_dataset(spec.job_id, spec.prompt_data, input_key=spec.input_key,
                                    label_key=spec.label_key, metadata_key=spec.metadata_key,
                                    apply_chat_template=spec.apply_chat_template,
                                    rollout_shuffle=spec.rollout_shuffle, rollout_seed=spec.rollout_seed)
    if info.num_prompts == 0:
        raise InvalidArgument(f"prompt_data {spec.prompt_data}: no usable prompts ({'; '.join(info.errors)})")
    ctx.report(-1, {}, f"dataset: {info.num_prompts} prompts, {info.num_skipped} rows skipped")
    backend = TorchBackend(spec.hf_checkpoint, train_config(spec), num_threads=deps.num_threads)
    engines, _ = deps.rollout.list_engines()
    broadcaster = WeightBroadcaster([e.url for e in engines], master_address=deps.master_address,
                                    backend=spec.weight_sync_backend, timeout_s=spec.weight_sync_timeout_s,
                                    bucket_bytes=spec.update_weight_buffer_size)
    try:
        # Like slime, push the trainer's weights before the first rollout: engines may hold another job's.
        sync_weights(broadcaster, backend, deps, version=0)
        for rollout_id in range(spec.num_rollout):
            ctx.check_cancelled()
            start = time.monotonic()
            groups = collect_rollout(spec, deps, rollout_id, str(rollout_id), ctx)
            samples = [s for g in sorted(groups, key=lambda g: g.group_id) for s in g.samples]
            rollout_s = time.monotonic() - start
            start = time.monotonic()
            steps = backend.train_rollout(samples)
            train_s = time.monotonic() - start
            sync = sync_weights(broadcaster, backend, deps, version=rollout_id + 1)
            metrics = {**rollout_metrics(samples), **mean_metrics(steps), **sync,
                       "perf/rollout_seconds": rollout_s, "perf/train_seconds": train_s}
            ctx.report(rollout_id, metrics)
            log.info("job %s rollout %d: reward %.3f loss %.4f (rollout %.1f s, train %.1f s)", spec.job_id,
                     rollout_id, metrics["rollout/reward_mean"], metrics.get("train/loss", float("nan")),
                     rollout_s, train_s)
        if spec.save_hf:
            backend.save_hf(spec.save_hf.format(rollout_id=spec.num_rollout - 1))
    finally:
        broadcaster.close()
