"""The vision-language multi-rank test's two gloo ranks: `python -m tests.integration.vision_ranks_worker
QWEN2_5_VL QWEN3_VL OUT`. One GRPO rollout with images (four groups: two with images, two of text) on each layout:
fsdp over both ranks (each reads its share of the groups, their images with them), megatron data-parallel, at
tensor parallelism 2 under sequence parallelism and over two pipeline stages. Rank 0 writes OUT/results.json."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.samples import Sample
from tests.unit.test_fsdp_vision import KEYS, vlm_samples

CONFIG = {"n_samples_per_prompt": 2, "global_batch_size": 4, "micro_batch_size": 2, "lr": 1e-3, "use_kl_loss": True,
          "kl_loss_coef": 0.1, "multimodal_keys": KEYS}


def rollout(model_dir: Path) -> list[Sample]:
    """Four groups of two samples rewarded 0 and 1, each step (global_batch_size 4) one with images and one of text:
    group 0 with one image, a text group, group 1 with two images, a text group. (A step without images would leave
    the vision tower without a gradient: torch's AdamW skips it, megatron's Adam steps it on its momentum.)"""
    with_images = vlm_samples(model_dir)
    text = with_images.pop()
    groups = [[Sample(tokens=list(text.tokens), response_length=text.response_length, reward=float(j),
                      group_index=group, index=j) for j in range(2)] for group in (2, 3)]
    return [*with_images[:2], *groups[0], *with_images[2:4], *groups[1]]


def one_rank(model_dir: Path) -> dict:
    """The same rollout on one process (fsdp, no group): the reference every layout is held to."""
    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.settings.train import TrainConfig

    samples = rollout(model_dir)
    backend = TorchBackend(model_dir, TrainConfig(**CONFIG), num_threads=1)
    return train(backend, samples, list(range(len(samples))))


def train(backend, samples: list[Sample], indexes: list[int]) -> dict:
    before = backend.compute_log_probs(samples)
    for sample, log_probs in zip(samples, before, strict=True):
        sample.rollout_log_probs = log_probs
    metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in backend.train_rollout(samples)]
    after = backend.compute_log_probs(samples)
    return {"indexes": indexes, "before": before, "metrics": metrics, "after": after}


def fsdp_two_ranks(model_dir: Path, rank: int) -> dict:
    """Each rank its share of the rollout's groups; the results of both, by sample position."""
    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.distributed.parallel import World, shard_rollout
    from services.trainer.settings.train import TrainConfig

    config = TrainConfig(**CONFIG)
    backend = TorchBackend(model_dir, dataclasses.replace(config, global_batch_size=2), num_threads=1,
                           world=World(rank=rank, world_size=2), job_global_batch_size=4)
    samples = rollout(model_dir)
    share = shard_rollout(samples, backend.rollout_share(), 2)
    out = train(backend, share, [samples.index(s) for s in share])
    every = [None, None]
    dist.all_gather_object(every, out)
    return {"ranks": every}


def on_megatron(model_dir: Path, **layout) -> dict:
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    backend = MegatronBackend(model_dir, TrainConfig(**CONFIG), num_threads=1, **layout)
    samples = rollout(model_dir)
    try:
        return train(backend, samples, list(range(len(samples))))
    finally:
        backend.close()


def run(rank: int, world_size: int, model_dirs: list[Path], out_dir: Path) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    dist.init_process_group("gloo")
    results = {}
    for model_dir in model_dirs:
        family = json.loads((model_dir / "config.json").read_text())["model_type"]
        results[f"{family}/fsdp_2"] = fsdp_two_ranks(model_dir, rank)
        results[f"{family}/megatron_dp2"] = on_megatron(model_dir)
        results[f"{family}/megatron_tp2_sp"] = on_megatron(model_dir, tensor_model_parallel_size=2,
                                                         megatron_args={"sequence_parallel": True})
        results[f"{family}/megatron_pp2"] = on_megatron(model_dir, pipeline_model_parallel_size=2)
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.fsdp.backend  # noqa: F401
    import services.trainer.backends.megatron.backend  # noqa: F401
    from bench.megatron_parity import spawn

    dirs, out = [Path(arg) for arg in sys.argv[1:-1]], Path(sys.argv[-1])
    (out / "one_rank.json").write_text(json.dumps({json.loads((d / "config.json").read_text())["model_type"]:
                                                   one_rank(d) for d in dirs}))
    spawn(run, dirs, out, start_method="spawn" if torch.cuda.is_available() else "fork")
