"""Samples of the tiny model written as text: (prompt, response, reward) triples tokenized by its character
tokenizer, each response ended by eos, for the trainer tests that need a rollout without engines; and a hand-written
two-prompt batch for the RL step's tests."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.samples import Sample
from services.trainer.batching.batch import RolloutBatch, build_rollout_batch

Rollout = list[tuple[str, str, float]]


def samples_of(model_dir: Path, rollout: Rollout) -> list[Sample]:
    vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    out = []
    for prompt, response, reward in rollout:
        response_ids = [vocab[c] for c in response] + [vocab["<|endoftext|>"]]
        out.append(Sample(tokens=[vocab[c] for c in prompt] + response_ids, response_length=len(response_ids),
                          reward=reward))
    return out


def two_by_two_batch() -> RolloutBatch:
    """Two prompts × two samples on the host; sample 2 has a masked (tool) token in the middle."""
    samples = [Sample(tokens=[1, 2, 3, 4], response_length=2, reward=1.0, rollout_log_probs=[-0.5, -0.5]),
               Sample(tokens=[1, 2, 5], response_length=1, reward=0.0, rollout_log_probs=[-0.5]),
               Sample(tokens=[1, 6, 7, 8], response_length=3, reward=0.0, loss_mask=[1, 0, 1],
                      rollout_log_probs=[-0.5, -0.5, -0.5]),
               Sample(tokens=[1, 6, 9], response_length=2, reward=2.0, rollout_log_probs=[-0.5, -0.5])]
    return build_rollout_batch(samples)
