"""Two gloo ranks for test_megatron_parity: bench/megatron_parity's HF parity scenarios, then the first ten GRPO
steps of MegatronBackend (five fixed synthetic rollouts of two steps) at TP=1 (DP=2), TP=2 and PP=2, each with a
checkpoint after rollout 2 that a fresh backend resumes from, and SFT steps at TP=2.

Run: python -m tests.integration.megatron_worker MODEL_DIR OUT_DIR  (writes OUT_DIR/results.json)
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from pathlib import Path

import torch

from bench.megatron_parity import LAYOUTS, build_tiny_qwen3, parity_scenario, spawn
from services.common.samples import Sample
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout

NUM_ROLLOUTS, CKPT_ROLLOUT = 5, 2  # 5 rollouts × 2 steps; the checkpoint after rollout 2 is resumed from
GRPO_LAYOUTS = ((1, 1, True), (2, 1, True), (1, 2, False))  # (tp, pp, use_distributed_optimizer) on a world of 2
SFT_CONFIG = {"global_batch_size": 4, "micro_batch_size": 3, "lr": 1e-3, "rollout_temperature": 0.7}
SFT_LOSSES = {"sft": {"loss_type": "sft_loss"},
              "custom": {"loss_type": "custom_loss", "custom_loss_function_path": "tests.plugins.loss_fns.mean_nll"}}


def grpo_scenario(model_dir: Path, out_dir: Path, *, tp: int, pp: int, distributed_optimizer: bool) -> dict:
    """Ten GRPO steps (checkpointed after rollout CKPT_ROLLOUT), the HF export, a reference update and an HF reload;
    then a fresh backend resumes from the checkpoint and trains the last rollouts again, and takes the checkpoint's
    policy as its reference model (ref_load)."""
    import torch.distributed as dist

    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.checkpoint import iterations
    from services.trainer.distributed.parallel import World
    from services.trainer.settings.train import TrainConfig

    world = World(rank=dist.get_rank(), world_size=dist.get_world_size())
    name = f"grpo-tp{tp}-pp{pp}"
    ckpt_root = out_dir / name / "ckpt"

    def build() -> MegatronBackend:
        return MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG), tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, use_distributed_optimizer=distributed_optimizer)

    backend = build()
    rollouts = [grpo_rollout(backend.arch.vocab_size, backend.pad_token_id, r) for r in range(NUM_ROLLOUTS)]
    samples = rollouts[0]
    before = backend.compute_log_probs(samples)
    metrics, save_seconds = [], 0.0
    for rollout_id, rollout in enumerate(rollouts):
        metrics += backend.train_rollout(rollout)
        if rollout_id == CKPT_ROLLOUT:
            start = time.monotonic()
            iterations.save_checkpoint(ckpt_root, rollout_id, backend, world, lambda: iterations.TrainerState(
                rollout_id=CKPT_ROLLOUT, job_id=name, world_size=world.world_size))
            save_seconds = time.monotonic() - start
            at_checkpoint = backend.compute_log_probs(samples)
    after = backend.compute_log_probs(samples)
    save_dir = out_dir / name / "hf"
    backend.save_hf(save_dir)
    backend.update_ref_model()
    kl_after_ref_update = backend.train_rollout(samples)[0]["train/kl_loss"]
    backend.load(model_dir)
    reloaded = backend.compute_log_probs(samples)
    backend.close()

    resumed = build()
    state = iterations.load_checkpoint(ckpt_root, resumed, world)
    resumed_version = resumed.weight_version
    resumed_metrics = [m for rollout in rollouts[state.rollout_id + 1:] for m in resumed.train_rollout(rollout)]
    resumed_after = resumed.compute_log_probs(samples)
    resumed_weights = dict(resumed.named_weights())
    iterations.load_reference(ckpt_root, resumed, world)
    ref_log_probs = _ref_log_probs(resumed, samples)
    resumed.close()
    if dist.get_rank() != 0:
        return {}
    from safetensors.torch import load_file

    final = load_file(save_dir / "model.safetensors")
    return {"tp": tp, "pp": pp, "metrics": metrics, "log_probs_before": before, "log_probs_after": after,
            "log_probs_reloaded": reloaded, "kl_after_ref_update": kl_after_ref_update, "save_dir": str(save_dir),
            "save_seconds": save_seconds,
            "checkpoint_files": sorted(p.name for p in iterations.iteration_dir(ckpt_root, CKPT_ROLLOUT).iterdir()),
            "resumed_rollout_id": state.rollout_id, "resumed_version": resumed_version,
            "resumed_metrics": resumed_metrics, "resumed_log_probs_after": resumed_after,
            "resumed_max_weight_diff": max((resumed_weights[k] - final[k]).abs().max().item() for k in final),
            "log_probs_at_checkpoint": at_checkpoint, "ref_loaded_log_probs": ref_log_probs}


def _ref_log_probs(backend, samples: list[Sample]) -> list[list[float]]:
    """The reference model's log-probs of `samples` (the backend's own recompute, run on its ref_model)."""
    from services.trainer.batching.batch import build_rollout_batch

    batch = build_rollout_batch(samples, pad_token_id=backend.pad_token_id)
    micro = backend._micro_batches(batch, list(range(batch.size)), training=False)
    log_probs = backend._log_probs(backend.ref_model, batch, micro)
    return [log_probs[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]


def sft_scenario(model_dir: Path, *, tp: int, pp: int, loss: str) -> list[dict]:
    """Two SFT steps, through sft_loss or the custom-loss path (logits gathered over TP)."""
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.settings.train import TrainConfig

    backend = MegatronBackend(model_dir, TrainConfig(**SFT_CONFIG, **SFT_LOSSES[loss]), tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp)
    metrics = backend.train_rollout(grpo_rollout(backend.arch.vocab_size, backend.pad_token_id))
    backend.close()
    return metrics


def run(rank: int, world_size: int, model_dir: Path, out_dir: Path, parity_dirs: list[Path]) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    parity = [parity_scenario(d, tp=tp, pp=pp) for d in parity_dirs for tp, pp in LAYOUTS]
    grpo = [grpo_scenario(model_dir, out_dir, tp=tp, pp=pp, distributed_optimizer=distributed)
            for tp, pp, distributed in GRPO_LAYOUTS]
    sft = {loss: sft_scenario(model_dir, tp=2, pp=1, loss=loss) for loss in SFT_LOSSES}
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps({"parity": parity, "grpo": grpo, "sft_tp2": sft}))


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    # Imported once here; the forked ranks inherit them.
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.megatron.backend  # noqa: F401

    model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    dirs = [build_tiny_qwen3(out_dir / name, tie_word_embeddings=tie) for name, tie in (("untied", False),
                                                                                       ("tied", True))]
    # fork shares the imports above with the ranks; CUDA cannot be re-initialized in a forked child, so spawn there
    spawn(run, model_dir, out_dir, dirs, start_method="spawn" if torch.cuda.is_available() else "fork")
