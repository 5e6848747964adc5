"""The demo's task files: the held-out pairs are trained on by neither job; the SFT warm-up sees one part."""

from __future__ import annotations

import json
from pathlib import Path

from physarum import tasks


def pairs(path: Path) -> set[tuple[int, int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = set()
    for row in rows:
        a, b = (int(x) for x in row["input"].removesuffix("=").split("+"))
        assert row["label"] == str(a + b), row
        out.add((a, b))
    return out


def test_the_warmup_sees_one_part_and_the_held_out_pairs_are_never_trained_on(tmp_path):
    train_path, test_path = tasks.write_addition_task(tmp_path, num_test=200, max_operand=99, seed=3)
    train, test, sft = pairs(train_path), pairs(test_path), pairs(tmp_path / "sft.jsonl")
    assert len(test) == 200 and len(train) == 100 * 100 - 200
    assert not test & train and not test & sft
    assert sft == {(a, b) for a, b in train if a <= b}
    # GRPO trains on the rest; the held-out test covers both parts
    assert any(a > b for a, b in test) and any(a <= b for a, b in test)
