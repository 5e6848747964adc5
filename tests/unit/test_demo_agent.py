"""`make demo-agent`'s warm-up trains the very tokens a gateway session produces for a worked trajectory (question,
a `solve` call, its result, the answer), its copy drills are that trajectory's last tokens, and the demo's response
budget holds the whole trajectory."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from examples.agent.model import _chat_rows, _drill_rows, build_agent_model
from examples.agent.solver import TOOL, solve
from physarum import demo_agent
from services.rollout.gateway.conversation import Limits, assistant_message, from_openai
from services.rollout.gateway.toolcalls import parse_tool_calls
from services.rollout.gateway.trajectory import Trajectory, sample_tokens
from services.rollout.generation.prompts import PromptEncoder

QUESTION = (7, 5, 350)


def _session_tokens(model_dir: Path) -> tuple[list[int], list[int], int]:
    """A gateway trajectory of the worked conversation, turn by turn as the agent sends it (the OpenAI client's
    message dumps): (tokens, loss mask of the response, prompt length)."""
    encoder = PromptEncoder(model_dir)
    worked = demo_agent.solved(*QUESTION)["messages"]
    trajectory = Trajectory(encoder)
    messages = [worked[0]]
    for reply in worked[1::2]:
        conversation = from_openai({"messages": messages, "tools": [TOOL]}, Limits())
        prepared = trajectory.prepare(conversation)
        # the engine's tokens: the turn as the template renders it, up to and including <|im_end|>
        text = encoder.render_messages([*worked[:1], reply], [TOOL], add_generation_prompt=False)
        generated = encoder.encode_text(text.split("<|im_start|>assistant\n")[1].removesuffix("\n"))
        content, calls = parse_tool_calls(encoder.decode(generated), conversation.tool_names)
        trajectory.record(prepared, conversation, assistant_message(content, [(c.name, c.arguments, c.id)
                                                                              for c in calls]),
                          generated, [0.0] * len(generated), ["0"], "stop", make_tip=True)
        # what the agent sends back: the OpenAI client's message, arguments as a JSON string, then the result
        sent = {"role": "assistant", "content": content}
        if calls:
            sent["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]
        messages.append(sent)
        messages += [{"role": "tool", "tool_call_id": c.id, "content": solve(messages)} for c in calls]
    tokens = sample_tokens(trajectory.tip)
    return tokens.tokens, tokens.loss_mask, len(tokens.tokens) - tokens.response_length


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_agent_model(tmp_path_factory.mktemp("agent") / "model")


def test_the_warm_up_trains_the_tokens_of_a_gateway_session(model_dir):
    ids, mask = _chat_rows(model_dir, [demo_agent.solved(*QUESTION)])[0]
    tokens, loss_mask, prompt_length = _session_tokens(model_dir)
    assert tokens == ids
    assert mask[:prompt_length] == [0] * prompt_length and loss_mask == mask[prompt_length:]
    # the tool's result is in the context, not trained; the answer copying it is trained
    text = PromptEncoder(model_dir).decode(tokens, skip_special_tokens=False)
    assert "<tool_response>\n385\n</tool_response>" in text and text.rstrip().endswith("385.<|im_end|>")


def test_the_demo_response_budget_holds_a_worked_trajectory(model_dir):
    tokens, _, prompt_length = _session_tokens(model_dir)
    budget = yaml.safe_load(demo_agent.JOB.read_text())["rollout_max_response_len"]
    assert len(tokens) - prompt_length <= budget
    assert demo_agent.MAX_RESPONSE_LEN == budget


def test_a_copy_drill_is_the_tool_turn_and_the_answer_of_the_trajectory(model_dir):
    worked = demo_agent.solved(*QUESTION)
    (ids, mask), = _drill_rows(model_dir, [worked])
    (full_ids, full_mask), = _chat_rows(model_dir, [worked])
    assert full_ids[-len(ids):] == ids and full_mask[-len(mask):] == mask
    def text(tokens: list[int]) -> str:
        return PromptEncoder(model_dir).decode(tokens, skip_special_tokens=False)

    assert text(ids) == ("\n<|im_start|>user\n<tool_response>\n385\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\nThe answer is 385.<|im_end|>")
    assert text([i for i, m in zip(ids, mask, strict=True) if m]) == "The answer is 385.<|im_end|>"
