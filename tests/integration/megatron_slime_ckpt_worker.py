"""One gloo rank for test_megatron_slime_checkpoint: checkpoints in slime's layout written by megatron-core's own
dist_checkpointing.save (as Megatron-LM writes them: the model's sharded tensors under Megatron's keys, an argparse
Namespace in the common state), then read back by MegatronBackend as --ref-load (`release`), --opd-teacher-load
(`iter_0000003`) and --load, and converted to an HF directory (slime_to_hf).

Run: python -m tests.integration.megatron_slime_ckpt_worker OUT_DIR  (writes OUT_DIR/results.json)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

import torch

from bench.megatron_parity import build_tiny_qwen3, spawn
from tests.integration.megatron_opd_worker import hf_log_probs
from tests.integration.megatron_worker import grpo_rollout

CONFIG = {"n_samples_per_prompt": 2, "global_batch_size": 4, "use_kl_loss": True, "use_opd": True,
          "opd_type": "megatron"}


def save_slime_layout(gpt, root: Path, iteration: str) -> None:
    """Megatron-LM's save: {root}/release or iter_N/ by dist_checkpointing.save, then the latest file."""
    from megatron.core import dist_checkpointing

    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    (root / name).mkdir(parents=True)
    state = {"model": gpt.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0,
             "args": argparse.Namespace(hidden_size=64)}  # what Megatron-LM pickles into common.pt
    dist_checkpointing.save(state, str(root / name))
    (root / "latest_checkpointed_iteration.txt").write_text(iteration)


def run(rank: int, world_size: int, out_dir: Path, student_dir: Path, teacher_dir: Path) -> None:
    from services.trainer.backends.base import TrainConfig
    from services.trainer.backends.batch import build_rollout_batch
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.distributed.parallel import World
    from services.trainer.driver import checkpoint

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    world = World()
    as_policy = MegatronBackend(teacher_dir, TrainConfig(n_samples_per_prompt=2))
    save_slime_layout(as_policy.gpt, out_dir / "release-root", "release")
    save_slime_layout(as_policy.gpt, out_dir / "iter-root", "3")
    as_policy.close()

    backend = MegatronBackend(student_dir, TrainConfig(**CONFIG))
    samples = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id)
    batch = build_rollout_batch(samples, pad_token_id=backend.pad_token_id)
    micro = backend._micro_batches(batch, list(range(batch.size)), training=False)

    def log_probs(model) -> list[list[float]]:
        out = backend._log_probs(model, batch, micro)
        return [out[i, :s.response_length].tolist() for i, s in enumerate(samples)]

    checkpoint.load_reference(out_dir / "release-root", backend, world)
    checkpoint.load_teacher(out_dir / "iter-root", backend, world)
    results = {"ref": log_probs(backend.ref_model), "teacher": log_probs(backend.teacher_model),
               "policy_before": log_probs(backend.model)}
    backend.load_megatron_checkpoint(checkpoint.slime_checkpoint(out_dir / "iter-root"), "model")
    results["policy_after"] = log_probs(backend.model)
    results["metrics"] = backend.train_rollout(samples)
    backend.close()
    from services.trainer.driver.slime_to_hf import convert

    converted = convert(student_dir, out_dir / "iter-root", out_dir / "converted")  # fsdp's way in
    results.update(student_hf=hf_log_probs(student_dir, samples), teacher_hf=hf_log_probs(teacher_dir, samples),
                   converted_hf=hf_log_probs(converted, samples))
    (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    student, teacher = (build_tiny_qwen3(out / name, tie_word_embeddings=False, seed=seed)
                        for name, seed in (("student", 0), ("teacher", 1)))
    spawn(run, out, student, teacher, world_size=1, start_method="spawn")
