"""Write the calculator agent's model and prompts: `python -m examples.agent.build OUT_DIR`.

OUT_DIR/model: a tiny model with a tools chat template (examples/agent/model.py), warmed up on a few worked
conversations (question, a calculator call, its result, the answer) so that it calls the tool at all;
OUT_DIR/train.jsonl and OUT_DIR/test.jsonl: questions with slime's keys `input` and `label` (held out: test).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

from examples.agent.calculator import TOOL
from examples.agent.model import build_agent_model


def question(a: int, b: int, c: int) -> dict[str, str]:
    return {"input": f"What is {a}*{b}+{c}?", "label": str(a * b + c)}


def worked(a: int, b: int, c: int) -> dict:
    """The conversation the warm-up teaches: one calculator call, then the answer."""
    return {"tools": [TOOL], "messages": [
        {"role": "user", "content": question(a, b, c)["input"]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}*{b}+{c}"}}}]},
        {"role": "tool", "content": str(a * b + c)},
        {"role": "assistant", "content": f"The answer is {a * b + c}."}]}


Triple = tuple[int, int, int]


def split_questions(num_warmup: int, num_train: int, num_test: int, seed: int = 0,
                    c_range: tuple[int, int] = (1, 99)) -> tuple[list[Triple], list[Triple], list[Triple]]:
    """Distinct (a, b, c) for a*b+c, a and b in 2..9, c in `c_range` (both ends in): the warm-up's, the train and the
    test questions (examples/multiturn/build.py asks the same ones)."""
    rng = random.Random(seed)
    triples: set[Triple] = set()
    while len(triples) < num_train + num_test + num_warmup:
        triples.add((rng.randint(2, 9), rng.randint(2, 9), rng.randint(*c_range)))
    ordered = sorted(triples)
    rng.shuffle(ordered)
    return ordered[:num_warmup], ordered[num_warmup:num_warmup + num_train], ordered[-num_test:]


def write_task(out_dir: Path, question_row: Callable[[int, int, int], dict[str, str]],
               warm_model: Callable[[Path, list[Triple]], Path], *, num_train: int, num_test: int, num_warmup: int,
               seed: int) -> tuple[Path, Path, Path]:
    """The model, warmed up on the warm-up questions, and the train and test prompts in an example's own wording
    (both calculator examples ask the same questions); returns their paths."""
    warmup, train, test = split_questions(num_warmup, num_train, num_test, seed)
    out_dir = Path(out_dir)
    paths = [warm_model(out_dir / "model", warmup)]
    for name, rows in (("train", train), ("test", test)):
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(question_row(*t)) + "\n" for t in rows))
        paths.append(path)
    return paths[0], paths[1], paths[2]


def cli(argv: list[str] | None, description: str, build_fn: Callable[..., tuple[Path, Path, Path]],
        warmup_help: str) -> int:
    """`OUT_DIR [--num-warmup N]`, for either example's build."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-warmup", type=int, default=4, help=warmup_help)
    args = parser.parse_args(argv)
    paths = build_fn(args.out_dir, num_warmup=args.num_warmup)
    sys.stdout.write("wrote " + ", ".join(map(str, paths)) + "\n")
    return 0


def build(out_dir: Path, *, num_train: int = 200, num_test: int = 20, num_warmup: int = 4,
          seed: int = 0) -> tuple[Path, Path, Path]:
    """The model and the train and test prompts (distinct questions); returns their paths."""
    def warm(model_dir: Path, warmup: list[Triple]) -> Path:
        return build_agent_model(model_dir, conversations=[worked(*t) for t in warmup])

    return write_task(out_dir, question, warm, num_train=num_train, num_test=num_test, num_warmup=num_warmup,
                      seed=seed)


if __name__ == "__main__":
    sys.exit(cli(None, __doc__, build, "worked conversations the model is warmed up on"))
