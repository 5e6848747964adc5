"""A warm start for the calculator example: `python -m examples.multiturn.build OUT_DIR [--num-warmup N]`.

OUT_DIR/model: the agent example's tiny model (examples/agent/model.py: same tokenizer, size and seed) warmed up on
N worked transcripts in this example's format (the question, `a*b+c=`, the calculator's answer, `The answer is R.`,
end of sequence), so the policy starts able to call the calculator; OUT_DIR/train.jsonl and OUT_DIR/test.jsonl: the
agent example's questions (examples/agent/build.py, same seed) in this example's wording. The two examples then
train on the same questions from the same model warmed up on the same worked questions, one through a custom
generate function, one through the agent gateway.
"""

from __future__ import annotations

import sys
from pathlib import Path

from examples.agent.build import cli, write_task
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
    return write_task(out_dir, question,
                      lambda model_dir, warmup: build_agent_model(model_dir, transcripts=[worked(*t) for t in warmup]),
                      num_train=num_train, num_test=num_test, num_warmup=num_warmup, seed=seed)


if __name__ == "__main__":
    sys.exit(cli(None, __doc__, build, "worked transcripts the model is warmed up on"))
