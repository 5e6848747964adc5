"""The gateway's /v1/responses driven by the real `openai` client's `responses.create`, in front of the real
sglang-router and a real CPU engine (through a recording proxy): plain, streamed, function tools and their outputs
sent back, `previous_response_id` within a session; each turn continues the session's engine tokens."""

from __future__ import annotations

import json

import openai
import pytest

from services.rollout.gateway.trajectory import sample_tokens
from tests.integration.gateway_fixtures import CALCULATOR_CONVERSATION, QUESTION, GatewayThread
from tests.integration.test_gateway import engine_turns, gateway, openai_client  # noqa: F401 (gateway: a fixture)

TOOL = {"type": "function", "name": "calculator", "description": "Arithmetic.",
        "parameters": CALCULATOR_CONVERSATION["tools"][0]["function"]["parameters"]}


def _state(gw: GatewayThread, key: str) -> dict:
    import httpx

    return httpx.get(f"{gw.url}/v1/session", headers={"Authorization": f"Bearer {key}"}, timeout=30.0).json()


def test_function_call_then_output_by_previous_response_id_trains_the_engine_tokens(gateway):  # noqa: F811
    gw, proxy = gateway
    session = gw.open()
    client = openai_client(gw, session.key)
    start = len(proxy.generated)
    first = client.responses.create(model="m", input=QUESTION, tools=[TOOL], temperature=0)
    assert first.status == "completed" and first.object == "response"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "2+3"}
    second = client.responses.create(model="m", previous_response_id=first.id, tools=[TOOL], temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert second.output_text == "The answer is 5." and second.previous_response_id == first.id
    assert [item.type for item in second.output] == ["message"]

    (in1, out1, _), (in2, out2, lp2) = engine_turns(proxy, start)
    assert (first.usage.input_tokens, first.usage.output_tokens) == (len(in1), len(out1))
    assert (second.usage.input_tokens, second.usage.output_tokens) == (len(in2), len(out2))
    assert in2[:len(in1) + len(out1)] == in1 + out1  # the second turn continues the engine's own tokens
    context = in2[len(in1) + len(out1):]
    assert gw.encoder.decode(context, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    trained = sample_tokens(session.trajectory.tip)
    assert trained.tokens == in2 + out2
    assert trained.loss_mask == [1] * len(out1) + [0] * len(context) + [1] * len(out2)
    assert trained.rollout_log_probs[-len(out2):] == lp2
    assert session.trajectory.branches == []


def test_history_sent_back_whole_continues_like_previous_response_id(gateway):  # noqa: F811
    """Without previous_response_id the agent sends the output items back itself (stateless, as the Codex CLI does):
    the same engine tokens as the stored history gives."""
    gw, proxy = gateway
    session = gw.open()
    client = openai_client(gw, session.key)
    start = len(proxy.generated)
    first = client.responses.create(model="m", input=QUESTION, tools=[TOOL], temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    history = [{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    second = client.responses.create(model="m", input=history, tools=[TOOL], temperature=0)
    assert second.output_text == "The answer is 5."
    (in1, out1, _), (in2, _, _) = engine_turns(proxy, start)
    assert in2[:len(in1) + len(out1)] == in1 + out1 and session.trajectory.branches == []


def test_stream_sends_the_events_and_the_text_as_it_is_generated(gateway):  # noqa: F811
    gw, proxy = gateway
    session = gw.open()
    client = openai_client(gw, session.key)
    first = client.responses.create(model="m", input=QUESTION, tools=[TOOL], temperature=0, stream=True)
    events = list(first)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    done = events[-1].response
    [call] = [item for item in done.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"expression": "2+3"}
    start = len(proxy.generated)
    second = client.responses.create(model="m", previous_response_id=done.id, tools=[TOOL], temperature=0,
                                     stream=True, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                          "output": "5"}])
    events = list(second)
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    [text_done] = [event for event in events if event.type == "response.output_text.done"]
    assert len(deltas) > 1 and "".join(deltas) == text_done.text == "The answer is 5."
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "The answer is 5."
    [(inputs, outputs, _)] = engine_turns(proxy, start)
    assert events[-1].response.usage.output_tokens == len(outputs)
    assert sample_tokens(session.trajectory.tip).tokens == inputs + outputs
    assert session.trajectory.branches == [] and _state(gw, session.key)["turns"] == 2


def test_unknown_or_foreign_previous_response_id_is_a_400(gateway):  # noqa: F811
    gw, _ = gateway
    mine, other = gw.open(), gw.open()
    foreign = openai_client(gw, other.key).responses.create(model="m", input=QUESTION, max_output_tokens=2)
    assert foreign.status == "incomplete" and foreign.incomplete_details.reason == "max_output_tokens"
    client = openai_client(gw, mine.key)
    unstored = client.responses.create(model="m", input=QUESTION, max_output_tokens=1, store=False)
    for previous in (foreign.id, "resp_unknown", unstored.id):
        with pytest.raises(openai.BadRequestError, match=f"Previous response with id '{previous}' not found") as err:
            client.responses.create(model="m", input="1", previous_response_id=previous)
        assert err.value.body["param"] == "previous_response_id" and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="only function tools") as err:
        client.responses.create(model="m", input="1", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="unrecognized request argument supplied: frobnicate"):
        client.responses.create(model="m", input="1", extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match=r"temperature: 3\.0 is out of range"):
        client.responses.create(model="m", input="1", temperature=3.0)
    assert _state(gw, mine.key)["turns"] == 1  # nothing refused reached the engine
