"""A fixed GRPO rollout and the settings it is trained with, the same on every run: for the tests and the benchmarks
that compare the backends (and precisions, and GPUs) on identical steps."""

from __future__ import annotations

import torch

from services.common.samples import Sample

GRPO_CONFIG = {"n_samples_per_prompt": 2, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-3,
               "use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01, "use_tis": True}


def grpo_rollout(vocab_size: int, pad_token_id: int, rollout_id: int = 0) -> list[Sample]:
    """8 samples (4 prompts × 2) with fixed tokens, rewards, engine log-probs and one masked token; each rollout id
    its own.

    No input is the pad token: HF embeddings never train the pad row (nn.Embedding padding_idx), Megatron's do.
    """
    gen = torch.Generator().manual_seed(7 + rollout_id)
    samples = []
    for i in range(8):
        prompt_len, response_len = 3 + (i + rollout_id) % 3, 2 + (i * 5 + rollout_id) % 4
        tokens = torch.randint(0, vocab_size - 1, (prompt_len + response_len,), generator=gen)
        tokens = (tokens + (tokens >= pad_token_id).long()).tolist()
        log_probs = (-0.5 - torch.rand(response_len, generator=gen) * 3).tolist()
        samples.append(Sample(tokens=tokens, response_length=response_len, reward=float((i + rollout_id) % 3 == 0),
                              rollout_log_probs=log_probs, group_index=i // 2))  # prompt i // 2
    samples[3].loss_mask = [1, 0] + [1] * (samples[3].response_length - 2)
    return samples
