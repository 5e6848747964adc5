"""Two gloo ranks for test_megatron_parity: bench/megatron_parity's HF parity scenarios, then the first GRPO steps
of MegatronBackend at TP=1 (DP=2), TP=2 and PP=2 on one fixed synthetic rollout, and SFT steps at TP=2.

Run: python -m tests.integration.megatron_worker MODEL_DIR OUT_DIR  (writes OUT_DIR/results.json)
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import torch

from bench.megatron_parity import LAYOUTS, build_tiny_qwen3, parity_scenario, spawn
from services.common.samples import Sample

GRPO_CONFIG = {"n_samples_per_prompt": 2, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-3,
               "use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01, "use_tis": True}

SFT_CONFIG = {"global_batch_size": 4, "micro_batch_size": 3, "lr": 1e-3, "rollout_temperature": 0.7}
SFT_LOSSES = {"sft": {"loss_type": "sft_loss"},
              "custom": {"loss_type": "custom_loss", "custom_loss_function_path": "tests.plugins.loss_fns.mean_nll"}}


def grpo_rollout(vocab_size: int, pad_token_id: int) -> list[Sample]:
    """8 samples (4 prompts × 2) with fixed tokens, rewards, engine log-probs and one masked token.

    No input is the pad token: HF embeddings never train the pad row (nn.Embedding padding_idx), Megatron's do.
    """
    gen = torch.Generator().manual_seed(7)
    samples = []
    for i in range(8):
        prompt_len, response_len = 3 + i % 3, 2 + (i * 5) % 4
        tokens = torch.randint(0, vocab_size - 1, (prompt_len + response_len,), generator=gen)
        tokens = (tokens + (tokens >= pad_token_id).long()).tolist()
        log_probs = (-0.5 - torch.rand(response_len, generator=gen) * 3).tolist()
        samples.append(Sample(tokens=tokens, response_length=response_len, reward=float(i % 3 == 0),
                              rollout_log_probs=log_probs))
    samples[3].loss_mask = [1, 0] + [1] * (samples[3].response_length - 2)
    return samples


def grpo_scenario(model_dir: Path, out_dir: Path, *, tp: int, pp: int) -> dict:
    import torch.distributed as dist

    from services.trainer.backends.base import TrainConfig
    from services.trainer.backends.megatron.backend import MegatronBackend

    backend = MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG), tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp)
    samples = grpo_rollout(backend.arch.vocab_size, backend.pad_token_id)
    before = backend.compute_log_probs(samples)
    metrics = backend.train_rollout(samples)
    after = backend.compute_log_probs(samples)
    save_dir = out_dir / f"grpo-tp{tp}-pp{pp}"
    backend.save_hf(save_dir)
    backend.update_ref_model()
    kl_after_ref_update = backend.train_rollout(samples)[0]["train/kl_loss"]
    backend.load(model_dir)
    reloaded = backend.compute_log_probs(samples)
    backend.close()
    if dist.get_rank() != 0:
        return {}
    return {"tp": tp, "pp": pp, "metrics": metrics, "log_probs_before": before, "log_probs_after": after,
            "log_probs_reloaded": reloaded, "kl_after_ref_update": kl_after_ref_update, "save_dir": str(save_dir)}


def sft_scenario(model_dir: Path, *, tp: int, pp: int, loss: str) -> list[dict]:
    """Two SFT steps, through sft_loss or the custom-loss path (logits gathered over TP)."""
    from services.trainer.backends.base import TrainConfig
    from services.trainer.backends.megatron.backend import MegatronBackend

    backend = MegatronBackend(model_dir, TrainConfig(**SFT_CONFIG, **SFT_LOSSES[loss]), tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp)
    metrics = backend.train_rollout(grpo_rollout(backend.arch.vocab_size, backend.pad_token_id))
    backend.close()
    return metrics


def run(rank: int, world_size: int, model_dir: Path, out_dir: Path, parity_dirs: list[Path]) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    parity = [parity_scenario(d, tp=tp, pp=pp) for d in parity_dirs for tp, pp in LAYOUTS]
    grpo = [grpo_scenario(model_dir, out_dir, tp=tp, pp=pp) for tp, pp in LAYOUTS]
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
    spawn(run, model_dir, out_dir, dirs, start_method="fork")
