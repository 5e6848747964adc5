"""A warm start for the calculator example: `python -m examples.multiturn.build OUT_DIR [--num-warmup N]`.

OUT_DIR/model: the agent example's tiny model (examples/agent/model.py: same tokenizer, size and seed) warmed up on
N worked transcripts in this example's format (the question, `a*b+c=`, the calculator's answer, `The answer is R.`,
end of sequence), so the policy starts able to call the calculator; OUT_DIR/train.jsonl and OUT_DIR/test.jsonl: the
agent example's questions (examples/agent/build.py, same seed) in this example's wording. The two examples then
train on the same questions from the same model warmed up on the same worked questions, one through a custom
generate function, one through the agent gateway.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from examples.agent.build import split_questions
from examples.agent.model import build_agent_model
from examples.multiturn.build_dataset import question


def worked(a: int, b: int, c: int) -> list[tuple[str, bool]]:
    """The transcript the warm-up teaches as (text, trained) pieces: the calculator's answer is not trained."""
    answer = str(a * b + c)
    return [(question(a, b, c)["input"], False), (f"{a}*{b}+{c}=", True), (f"{answer}\n", False),
            (f"The answer is {answer}.", True)]


def build(out_dir: Path, *, num_train: int = 200, num_test: int = 20, num_warmup: int = 4,
          seed: int = 0) -> tuple[Path, Path, Path]:
    """The model and the train and test prompts; returns their paths."""
    warmup, train, test = split_questions(num_warmup, num_train, num_test, seed)
    out_dir = Path(out_dir)
    model = build_agent_model(out_dir / "model", transcripts=[worked(*t) for t in warmup])
    paths = [model]
    for name, rows in (("train", train), ("test", test)):
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(question(*t)) + "\n" for t in rows))
        paths.append(path)
    return paths[0], paths[1], paths[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-warmup", type=int, default=4, help="worked transcripts the model is warmed up on")
    args = parser.parse_args(argv)
    paths = build(args.out_dir, num_warmup=args.num_warmup)
    sys.stdout.write("wrote " + ", ".join(map(str, paths)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
