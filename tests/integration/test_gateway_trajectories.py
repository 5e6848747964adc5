"""The trajectories agents produce, through the real `openai` and `anthropic` clients, the gateway, sglang-router and
a CPU engine (through a recording proxy): parallel tool calls and their results in one message; broken tool calls
returned and trained as the model wrote them; a history re-sent in another rendering continuing the engine's tokens.
Each checks that the trained tokens are the engine's and that loss_mask is 0 exactly where the model did not write.
Bad agent input is refused with a 4xx naming its bound, and the session goes on."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from examples.agent.model import build_agent_model
from services.rollout.gateway.trajectory import sample_tokens
from testkit.engines import start_engines, stop_engines
from tests.integration.engine_proxy import EngineProxy
from tests.integration.gateway_fixtures import (
    ANTHROPIC_TOOL,
    OPENAI_TOOL,
    PARALLEL,
    PARALLEL_CONVERSATION,
    GatewayThread,
)

TIMEOUT_S = 120.0
BROKEN = "What is 7-1?"
UNOFFERED = "Search for 7."
BROKEN_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7-1"}\n</tool_call>'  # one } short
UNOFFERED_CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "7"}}\n</tool_call>'


# What the tiny model is taught: two calls in one turn (then an answer after both results), a call whose JSON does
# not parse, and a call to a tool it was not offered.
CONVERSATIONS = [
    PARALLEL_CONVERSATION,
    {"tools": [OPENAI_TOOL], "messages": [{"role": "user", "content": BROKEN},
                                          {"role": "assistant", "content": BROKEN_CALL}]},
    {"tools": [OPENAI_TOOL], "messages": [{"role": "user", "content": UNOFFERED},
                                          {"role": "assistant", "content": UNOFFERED_CALL}]},
]


@pytest.fixture(scope="module")
def gateway(shared_router, session_dir):
    model_dir = build_agent_model(session_dir / "trajectory-model", conversations=CONVERSATIONS, warmup_steps=400)
    engines = start_engines(model_dir, session_dir / "trajectory-engine", 1)
    proxy = EngineProxy(engines[0][1])
    gw = None
    try:
        shared_router.add_worker(proxy.url, timeout_s=30)
        gw = GatewayThread(model_dir, shared_router.url)
        yield gw, proxy
    finally:
        if gw is not None:
            gw.close()
        proxy.close()
        stop_engines(engines)


def openai_client(gw: GatewayThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, timeout=TIMEOUT_S, max_retries=0)


def anthropic_client(gw: GatewayThread, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, timeout=TIMEOUT_S, max_retries=0)


def engine_turns(proxy: EngineProxy, since: int) -> list[tuple[list[int], list[int]]]:
    return [(request["input_ids"], [e[1] for e in reply["meta_info"]["output_token_logprobs"]])
            for request, reply in proxy.since(since)]


def assert_trained_as_generated(session, turns: list[tuple[list[int], list[int]]]) -> None:
    """The session's sample is the engine's last input and output; each turn's input continues the one before
    exactly; loss_mask is 1 on every generated token and 0 on every token between (tool results, template)."""
    trained = sample_tokens(session.trajectory.tip)
    last_in, last_out = turns[-1]
    assert trained.tokens == last_in + last_out
    mask = []
    for (before_in, before_out), (after_in, _) in zip(turns, turns[1:], strict=False):
        assert after_in[:len(before_in) + len(before_out)] == before_in + before_out
        mask += [1] * len(before_out) + [0] * (len(after_in) - len(before_in) - len(before_out))
    assert trained.loss_mask == mask + [1] * len(last_out)
    assert trained.response_length == len(trained.tokens) - len(turns[0][0])
    assert session.trajectory.branches == []


def test_parallel_tool_calls_and_their_results_in_one_message_openai(gateway):
    gw, proxy = gateway
    session = gw.open(max_new_tokens=600)
    client = openai_client(gw, session.key)
    start = len(proxy.generated)
    messages = [{"role": "user", "content": PARALLEL}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0)
    calls = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "2+3"}), ("calculator", {"expression": "4*5"})]
    assert calls[0].id != calls[1].id
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "5"},
                 {"role": "tool", "tool_call_id": calls[1].id, "content": "20"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0)
    assert second.choices[0].message.content == "5 and 20."
    turns = engine_turns(proxy, start)
    assert len(turns) == 2
    (in1, out1), (in2, _) = turns
    # both results, one after the other, in the turn between the two generations
    assert gw.encoder.decode(in2[len(in1) + len(out1):], skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n20\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert_trained_as_generated(session, turns)


def test_parallel_calls_streamed_and_through_the_responses_api(gateway):
    """The same two calls streamed (two tool_calls deltas by index), and as two function_call items whose two
    outputs continue the turn by previous_response_id."""
    gw, proxy = gateway
    stream = openai_client(gw, gw.open(max_new_tokens=600).key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": PARALLEL}], tools=[OPENAI_TOOL], temperature=0, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for delta_choice in chunk.choices:
            for delta in delta_choice.delta.tool_calls or []:
                calls.setdefault(delta.index, "")
                calls[delta.index] += delta.function.arguments or ""
            finish = delta_choice.finish_reason or finish
    assert finish == "tool_calls" and {i: json.loads(a) for i, a in calls.items()} == {
        0: {"expression": "2+3"}, 1: {"expression": "4*5"}}
    session = gw.open(max_new_tokens=600)
    client = openai_client(gw, session.key)
    start = len(proxy.generated)
    tool = {"type": "function", "name": "calculator", "description": "Arithmetic.",
            "parameters": OPENAI_TOOL["function"]["parameters"]}
    first = client.responses.create(model="m", input=PARALLEL, tools=[tool], temperature=0)
    items = [item for item in first.output if item.type == "function_call"]
    assert [json.loads(item.arguments) for item in items] == [{"expression": "2+3"}, {"expression": "4*5"}]
    second = client.responses.create(model="m", previous_response_id=first.id, tools=[tool], temperature=0, input=[
        {"type": "function_call_output", "call_id": items[0].call_id, "output": "5"},
        {"type": "function_call_output", "call_id": items[1].call_id, "output": "20"}])
    assert second.output_text == "5 and 20."
    assert_trained_as_generated(session, engine_turns(proxy, start))


def test_parallel_tool_use_blocks_and_their_results_in_one_message_anthropic(gateway):
    gw, proxy = gateway
    session = gw.open(max_new_tokens=600)
    client = anthropic_client(gw, session.key)
    start = len(proxy.generated)
    messages = [{"role": "user", "content": PARALLEL}]
    first = client.messages.create(model="m", max_tokens=300, messages=messages, tools=[ANTHROPIC_TOOL])
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and [u.input for u in uses] == [{"expression": "2+3"},
                                                                           {"expression": "4*5"}]
    messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "5"},
                                              {"type": "tool_result", "tool_use_id": uses[1].id, "content": "20"}]}]
    second = client.messages.create(model="m", max_tokens=300, messages=messages, tools=[ANTHROPIC_TOOL])
    assert [b.text for b in second.content if b.type == "text"] == ["5 and 20."]
    assert_trained_as_generated(session, engine_turns(proxy, start))


@pytest.mark.parametrize(("question", "written"), [(BROKEN, BROKEN_CALL), (UNOFFERED, UNOFFERED_CALL)],
                         ids=["json-that-does-not-parse", "a-tool-not-offered"])
def test_a_broken_tool_call_is_returned_and_trained_as_the_model_wrote_it(gateway, question, written):
    """Not a call the agent could run: it comes back as the model's text (as SGLang's parser leaves it), finish
    "stop"; sent back with the agent's complaint, the session continues from the engine's tokens, which train."""
    gw, proxy = gateway
    session = gw.open(max_new_tokens=600)
    client = openai_client(gw, session.key)
    start = len(proxy.generated)
    messages = [{"role": "user", "content": question}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0)
    choice = first.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (written, None, "stop")
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "user", "content": "That call could not run: call calculator with JSON arguments."}]
    client.chat.completions.create(model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0, max_tokens=8)
    turns = engine_turns(proxy, start)
    assert gw.encoder.decode(turns[0][1], skip_special_tokens=False) == written + "<|im_end|>"
    assert_trained_as_generated(session, turns)
    # the Messages API returns it as a text block, as written, and takes it back the same way
    session = gw.open(max_new_tokens=600)
    start = len(proxy.generated)
    reply = anthropic_client(gw, session.key).messages.create(model="m", max_tokens=300, tools=[ANTHROPIC_TOOL],
                                                              messages=[{"role": "user", "content": question}])
    assert [(b.type, b.text) for b in reply.content] == [("text", written)] and reply.stop_reason == "end_turn"
    sent_back = {"role": "assistant", "content": [b.model_dump() for b in reply.content]}
    anthropic_client(gw, session.key).messages.create(model="m", max_tokens=8, tools=[ANTHROPIC_TOOL], messages=[
        {"role": "user", "content": question}, sent_back, {"role": "user", "content": "That call could not run."}])
    assert_trained_as_generated(session, engine_turns(proxy, start))


def test_arguments_the_agent_mangles_are_refused_in_the_apis_error_shape(gateway):
    gw, _ = gateway
    client = openai_client(gw, gw.open(max_new_tokens=600).key)
    bad = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "7-1"'}}]}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", tools=[OPENAI_TOOL], messages=[
            {"role": "user", "content": BROKEN}, bad, {"role": "tool", "tool_call_id": "c1", "content": "6"}])
    assert err.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
    assert err.value.body["type"] == "invalid_request_error" and "not JSON" in err.value.body["message"]


def test_a_history_re_sent_in_another_rendering_continues_the_engines_tokens(gateway):
    """The agent sends back the parallel turn with its arguments re-serialized, its texts re-spaced and its system
    prompt moved to the end: no branch, nothing re-tokenised, the tool results appended after the engine's tokens."""
    gw, proxy = gateway
    session = gw.open(max_new_tokens=600)
    client = openai_client(gw, session.key)
    start = len(proxy.generated)
    system = {"role": "system", "content": "Use the calculator."}
    first = client.chat.completions.create(model="m", tools=[OPENAI_TOOL], temperature=0, max_tokens=60,
                                           messages=[system, {"role": "user", "content": PARALLEL}])
    produced = first.choices[0].message.model_dump(exclude_none=True)
    for tool_call in produced.get("tool_calls", []):
        tool_call["function"]["arguments"] = json.dumps(json.loads(tool_call["function"]["arguments"]), indent=2)
    produced["content"] = f"\n  {produced.get('content') or ''}  \n"
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "5"} for c in produced.get("tool_calls", [])]
    client.chat.completions.create(model="m", tools=[OPENAI_TOOL], temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": f"  {PARALLEL}\n"}, produced,
        *(results or [{"role": "user", "content": "go on"}]), {**system, "content": " Use the  calculator. "}])
    assert_trained_as_generated(session, engine_turns(proxy, start))


def test_bad_agent_input_gets_a_4xx_naming_the_bound_and_the_session_goes_on(gateway):
    """Each refused before any generation, in its API's error shape, with the gateway's default bounds; the same
    session then completes its turn."""
    gw, proxy = gateway
    session = gw.open(max_new_tokens=600)
    client, claude = openai_client(gw, session.key), anthropic_client(gw, session.key)
    user = [{"role": "user", "content": PARALLEL}]
    start = len(proxy.generated)
    with pytest.raises(openai.APIStatusError, match=r"request body of \d+ bytes, at most 4194304") as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (10 << 20)}])
    assert err.value.status_code == 413
    # the clients refuse to send NaN; Python's json module writes it, so an agent's own HTTP code can
    for path, body in [("/v1/chat/completions", {"messages": user, "temperature": float("nan")}),
                       ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": user, "top_p": float("inf")})]:
        reply = httpx.post(f"{gw.url}{path}", content=json.dumps(body), timeout=TIMEOUT_S,
                           headers={"Authorization": f"Bearer {session.key}", "content-type": "application/json"})
        assert reply.status_code == 400 and ("NaN is not JSON" in reply.text or "Infinity is not JSON" in reply.text)
    with pytest.raises(openai.BadRequestError, match="type must be one of object") as err:
        client.chat.completions.create(model="m", messages=user, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "banana"}}}}}])
    assert err.value.body["param"] == "tools[0].function.parameters.properties.x.type"
    with pytest.raises(anthropic.BadRequestError, match="required must be a list"):
        claude.messages.create(model="m", max_tokens=8, messages=user, tools=[
            {"name": "f", "input_schema": {"type": "object", "required": "x"}}])
    with pytest.raises(openai.BadRequestError, match="tools: 1000 tools, at most 64 per request"):
        client.chat.completions.create(model="m", messages=user, tools=[OPENAI_TOOL] * 1000)
    with pytest.raises(openai.BadRequestError, match="messages: 10000 messages, at most 512 per request"):
        client.chat.completions.create(model="m", messages=user * 10000)
    with pytest.raises(openai.BadRequestError, match="input: 10000 messages|at most 512"):
        client.responses.create(model="m", input=[{"role": "user", "content": "q"}] * 10000)
    assert len(proxy.generated) == start and session.num_turns == 0  # nothing reached the engine
    reply = client.chat.completions.create(model="m", messages=user, tools=[OPENAI_TOOL], temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls" and session.num_turns == 1
