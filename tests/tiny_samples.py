"""Samples of the tiny model written as text: (prompt, response, reward) triples tokenized by its character
tokenizer, each response ended by eos, for the trainer tests that need a rollout without engines."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.samples import Sample

Rollout = list[tuple[str, str, float]]


def samples_of(model_dir: Path, rollout: Rollout) -> list[Sample]:
    vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    out = []
    for prompt, response, reward in rollout:
        response_ids = [vocab[c] for c in response] + [vocab["<|endoftext|>"]]
        out.append(Sample(tokens=[vocab[c] for c in prompt] + response_ids, response_length=len(response_ids),
                          reward=reward))
    return out
