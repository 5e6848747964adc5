"""The calculator examples' warm starts: both ask the same questions, and the custom-generate example's worked
transcripts train exactly the tokens its generate function would have the model write."""

from __future__ import annotations

import pytest

from examples.agent.build import split_questions
from examples.agent.model import _text_rows, build_agent_model
from examples.multiturn.build import worked
from examples.multiturn.calculator import CALL, calculate
from services.rollout.generation.prompts import PromptEncoder


def test_split_questions_are_distinct_and_in_range():
    warmup, train, test = split_questions(4, 30, 10, seed=0)
    assert (len(warmup), len(train), len(test)) == (4, 30, 10)
    assert len(set(warmup) | set(train) | set(test)) == 44
    assert all(2 <= a <= 9 and 2 <= b <= 9 and 1 <= c <= 99 for a, b, c in warmup + train + test)
    assert split_questions(4, 30, 10, seed=0) == (warmup, train, test)


def test_multiturn_transcript_is_what_generate_would_append():
    pieces = worked(3, 4, 5)
    call, answer = pieces[1][0], pieces[2][0]
    assert call.endswith(CALL) and calculate(call) == "17" and answer == "17\n"  # generate appends result + "\n"
    assert [trained for _, trained in pieces] == [False, True, False, True]
    assert pieces[3][0] == "The answer is 17."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_agent_model(tmp_path_factory.mktemp("agent-model") / "model")


def test_text_rows_train_the_model_pieces_and_the_end_of_sequence(model_dir):
    encoder = PromptEncoder(model_dir)
    pieces = worked(3, 4, 5)
    [(ids, mask)] = _text_rows(model_dir, [pieces])
    assert ids == encoder.encode_text("".join(text for text, _ in pieces)) + [encoder.eos_token_id]
    assert encoder.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "3*4+5=The answer is 17."
    assert mask[-1] == 1 and ids[-1] == encoder.eos_token_id
