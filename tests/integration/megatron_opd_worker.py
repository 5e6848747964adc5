"""One gloo rank for test_megatron_opd: MegatronBackend with on-policy distillation's teacher model (opd_type
megatron), loaded from an HF directory and from a checkpoint root; its log-probs against the HF teacher's own
forward, and a GRPO rollout with the reverse-KL term.

Run: python -m tests.integration.megatron_opd_worker OUT_DIR  (writes OUT_DIR/results.json)
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import torch

from bench.megatron_parity import build_tiny_qwen3, spawn
from testkit.grpo_rollout import grpo_rollout

OPD_CONFIG = {"n_samples_per_prompt": 2, "global_batch_size": 4, "lr": 1e-3, "use_opd": True,
              "opd_type": "megatron", "opd_kl_coef": 0.5}


def hf_log_probs(model_dir: Path, samples) -> list[list[float]]:
    """The HF model's own log-probs of each sample's response tokens (temperature 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens])
            scored = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(scored[-s.response_length:].tolist())
    return out


def run(rank: int, world_size: int, out_dir: Path, student_dir: Path, teacher_dir: Path) -> None:
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.batching.batch import build_rollout_batch
    from services.trainer.checkpoint import iterations
    from services.trainer.distributed.parallel import World
    from services.trainer.settings.train import TrainConfig

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    world = World()
    # the teacher as a policy, saved as a checkpoint root (what --opd-teacher-load of a checkpoint reads)
    as_policy = MegatronBackend(teacher_dir, TrainConfig(n_samples_per_prompt=2))
    root = out_dir / "teacher-ckpt"
    iterations.save_checkpoint(root, 4, as_policy, world,
                                lambda: iterations.TrainerState(rollout_id=4, job_id="teacher", world_size=1))
    as_policy.close()

    backend = MegatronBackend(student_dir, TrainConfig(**OPD_CONFIG))
    samples = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id)
    batch = build_rollout_batch(samples, pad_token_id=backend.pad_token_id)
    micro = backend._micro_batches(batch, list(range(batch.size)), training=False)

    def teacher_log_probs() -> list[list[float]]:
        out = backend._log_probs(backend.teacher_model, batch, micro)
        return [out[i, :s.response_length].tolist() for i, s in enumerate(samples)]

    before = teacher_log_probs()  # the student's own weights until a teacher is loaded
    iterations.load_teacher(teacher_dir, backend, world)
    from_hf = teacher_log_probs()
    iterations.load_teacher(root, backend, world)
    from_checkpoint = teacher_log_probs()
    metrics = backend.train_rollout(samples)
    backend.close()
    (out_dir / "results.json").write_text(json.dumps({
        "student_hf": hf_log_probs(student_dir, samples), "teacher_hf": hf_log_probs(teacher_dir, samples),
        "before": before, "from_hf": from_hf, "from_checkpoint": from_checkpoint, "metrics": metrics}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    student, teacher = (build_tiny_qwen3(out / name, tie_word_embeddings=False, seed=seed)
                        for name, seed in (("student", 0), ("teacher", 1)))
    spawn(run, out, student, teacher, world_size=1, start_method="spawn")
