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


def write_addition_task(out_dir: Path, *, num_test: int = 200, max_operand: int = 99,
                        seed: int = 0) -> tuple[Path, Path]:
    """Write train.jsonl and test.jsonl (held out); returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = addition_pairs(max_operand)
    random.Random(seed).shuffle(pairs)
    paths = []
    for name, split in (("train", pairs[num_test:]), ("test", pairs[:num_test])):
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in addition_rows(split)))
        paths.append(path)
    return paths[0], paths[1]


def corpus() -> list[str]:
    """Every character the addition task uses, for training the tokenizer."""
    return ["0123456789+=", "-*/ ()\n", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ.,:?!"]
