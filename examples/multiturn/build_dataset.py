"""Write the calculator example's prompts: `python -m examples.multiturn.build_dataset OUT_DIR`.

Rows use slime's keys, `input` (the question) and `label` (the exact answer): train.jsonl and a held-out test.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def question(a: int, b: int, c: int) -> dict[str, str]:
    return {"input": f"Compute {a}*{b}+{c} with the calculator (end with =).\n", "label": str(a * b + c)}


def write_dataset(out_dir: Path, *, num_train: int = 200, num_test: int = 20, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl of distinct questions; returns their paths."""
    rng = random.Random(seed)
    triples: set[tuple[int, int, int]] = set()
    while len(triples) < num_train + num_test:
        triples.add((rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 999)))
    ordered = sorted(triples)
    rng.shuffle(ordered)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train", ordered[:num_train]), ("test", ordered[num_train:])):
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(question(*t)) + "\n" for t in rows))
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-train", type=int, default=200)
    parser.add_argument("--num-test", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, test = write_dataset(args.out_dir, num_train=args.num_train, num_test=args.num_test, seed=args.seed)
    sys.stdout.write(f"wrote {train} and {test}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
