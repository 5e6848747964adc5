"""Synthetic verifiable tasks for the demo and the tests: small arithmetic with exact answers."""

from __future__ import annotations

import json
import random
from pathlib import Path


def addition_pairs(max_operand: int = 99) -> list[tuple[int, int]]:
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def addition_rows(pairs: list[tuple[int, int]]) -> list[dict[str, str]]:
    """Rows with slime's default keys: `input` (the prompt) and `label` (the exact answer)."""
    return [{"input": f"{a}+{b}=", "label": str(a + b)} for a, b in pairs]


def in_warmup_part(a: int, b: int) -> bool:
    """The demo's SFT curriculum: the warm-up sees only sums written smaller operand first (a <= b); GRPO and the
    held-out test cover both orders, so what the model learns about `a+b` with a > b comes from RL."""
    return a <= b


def write_rows(path: Path, pairs: list[tuple[int, int]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in addition_rows(pairs)))
    return path


def write_addition_task(out_dir: Path, *, num_test: int = 200, max_operand: int = 99,
                        seed: int = 0) -> tuple[Path, Path]:
    """Write train.jsonl, test.jsonl (held out) and sft.jsonl (the train pairs `in_warmup_part`); returns the paths
    of train and test. The test pairs are in neither train file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = addition_pairs(max_operand)
    random.Random(seed).shuffle(pairs)
    train, test = pairs[num_test:], pairs[:num_test]
    write_rows(out_dir / "sft.jsonl", [pair for pair in train if in_warmup_part(*pair)])
    return write_rows(out_dir / "train.jsonl", train), write_rows(out_dir / "test.jsonl", test)


def corpus() -> list[str]:
    """Every character the addition task uses, for training the tokenizer."""
    return ["0123456789+=", "-*/ ()\n", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ.,:?!"]
