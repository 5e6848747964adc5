"""The calculator examples' warm starts: both ask the same questions, and the custom-generate example's worked
transcripts train exactly the tokens its generate function would have the model write."""

from __future__ import annotations

import re

import pytest

from examples.agent.build import split_questions
from examples.agent.build import worked as agent_worked
from examples.agent.calculator import TOOL
from examples.agent.model import _chat_rows, _new_model, _text_rows, _warm_up, build_agent_model
from examples.multiturn.build import worked
from examples.multiturn.calculator import CALL, calculate
from services.rollout.generation.prompts import PromptEncoder

CALL_TEXT = r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": "\d\*\d\+\d+"\}\}\n</tool_call>'


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


def test_agent_warm_up_converges_and_writes_the_call_the_gateway_prompt_asks_for(model_dir):
    """The warm-up's loss falls below its stopping threshold within its step budget (its learning rate anneals:
    at a constant rate it oscillated and the call miscopied the question's numbers), and, prompted as the gateway
    prompts (the template with the tools and the generation prompt), the warmed model writes a calculator call
    greedily, ending its turn at <|im_end|>, mostly with the worked conversation's own expression."""
    import torch

    encoder = PromptEncoder(model_dir)
    conversations = [agent_worked(*t) for t in split_questions(4, 0, 0, seed=0)[0]]
    model = _new_model(model_dir, max_positions=512, hidden_size=64, num_layers=2, seed=0)
    assert _warm_up(model, _chat_rows(model_dir, conversations), steps=300) < 0.01
    end_of_turn = encoder.tokenizer.token_to_id("<|im_end|>")
    exact = 0
    for conversation in conversations:
        messages = conversation["messages"]
        prompt = encoder.encode_text(encoder.render_messages(messages[:1], [TOOL], add_generation_prompt=True))
        call = encoder.render_messages(messages[:2], [TOOL], add_generation_prompt=False)
        expected = encoder.encode_text(call.removesuffix("\n"))[len(prompt):]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(expected) + 5, do_sample=False,
                                 eos_token_id=[end_of_turn], pad_token_id=end_of_turn)
        written = out[0, len(prompt):].tolist()
        assert written[-1] == end_of_turn == expected[-1]
        assert re.fullmatch(CALL_TEXT, encoder.decode(written)), encoder.decode(written)
        exact += written == expected
    assert exact >= 3
