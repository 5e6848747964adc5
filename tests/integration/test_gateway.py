"""The agent gateway driven by the real `openai` and `anthropic` clients, in front of the real sglang-router and a
real CPU engine (through a recording proxy): plain and streamed completions, tools, multi-turn; the trained tokens
are the engine's own, with masks and log-probs; an edited history is a reported branch; bounds answer 4xx."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from services.rollout.gateway.conversation import Limits
from services.rollout.gateway.trajectory import sample_tokens
from testkit.engines import start_engines, stop_engines
from tests.integration.engine_proxy import EngineProxy
from tests.integration.gateway_fixtures import (
    ANTHROPIC_TOOL,
    CALCULATOR_CONVERSATION,
    OPENAI_TOOL,
    QUESTION,
    GatewayThread,
    build_tool_model,
)

TIMEOUT_S = 120.0
RESPONSES_TOOL = {"type": "function", "name": "calculator", "description": "Arithmetic.",
                  "parameters": OPENAI_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def gateway(shared_router, session_dir):
    model_dir = build_tool_model(session_dir / "agent-model")
    engines = start_engines(model_dir, session_dir / "gateway-engine", 1)
    proxy = EngineProxy(engines[0][1])
    gateway = None
    try:
        shared_router.add_worker(proxy.url, timeout_s=30)
        gateway = GatewayThread(model_dir, shared_router.url, Limits(max_body_bytes=64 << 10, max_tools=4,
                                                                      max_turns=6, max_choices=2))
        yield gateway, proxy
    finally:
        if gateway is not None:
            gateway.close()
        proxy.close()
        stop_engines(engines)


def openai_client(gateway: GatewayThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, timeout=TIMEOUT_S, max_retries=0)


def anthropic_client(gateway: GatewayThread, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, timeout=TIMEOUT_S, max_retries=0)


def engine_turns(proxy: EngineProxy, since: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(input_ids, output ids, output log-probs) of each /generate the engine answered since record `since`."""
    turns = []
    for request, reply in proxy.since(since):
        entries = reply["meta_info"]["output_token_logprobs"]
        turns.append((request["input_ids"], [e[1] for e in entries], [e[0] for e in entries]))
    return turns


def test_openai_tool_call_then_answer_trains_the_engine_tokens(gateway):
    gw, proxy = gateway
    session = gw.open()
    client = openai_client(gw, session.key)
    assert [m.id for m in client.models.list()] == [session.model]
    start = len(proxy.generated)
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=session.model, messages=messages, tools=[OPENAI_TOOL],
                                           temperature=0, logprobs=True)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+3"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = client.chat.completions.create(model=session.model, messages=messages, tools=[OPENAI_TOOL],
                                            temperature=0)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "The answer is 5."

    (in1, out1, lp1), (in2, out2, lp2) = engine_turns(proxy, start)
    assert first.usage.prompt_tokens == len(in1) and first.usage.completion_tokens == len(out1)
    assert second.usage.prompt_tokens == len(in2) and second.usage.completion_tokens == len(out2)
    assert [c.logprob for c in choice.logprobs.content] == lp1
    # the second request continues the engine's own tokens: nothing before them was re-tokenised
    assert in2[:len(in1) + len(out1)] == in1 + out1
    context = in2[len(in1) + len(out1):]
    assert gw.encoder.decode(context, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    trained = sample_tokens(session.trajectory.tip)
    assert trained.tokens == in2 + out2
    assert trained.response_length == len(out1) + len(context) + len(out2)
    assert trained.loss_mask == [1] * len(out1) + [0] * len(context) + [1] * len(out2)
    assert trained.rollout_log_probs == lp1 + [0.0] * len(context) + lp2
    assert trained.weight_versions == ["default"]
    assert session.trajectory.branches == []


def test_openai_stream_and_n_match_the_plain_reply(gateway):
    gw, _ = gateway
    messages = [{"role": "user", "content": QUESTION}]
    plain = openai_client(gw, gw.open().key).chat.completions.create(
        model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0, n=2)
    assert len(plain.choices) == 2 and plain.choices[0].message.tool_calls[0].function.name == "calculator"
    calls_of = [c.message.tool_calls[0].function.arguments for c in plain.choices]
    assert calls_of[0] == calls_of[1]  # greedy: both choices are the same tokens
    stream = openai_client(gw, gw.open().key).chat.completions.create(
        model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0, stream=True,
        stream_options={"include_usage": True})
    calls, finish, usage = {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for delta_choice in chunk.choices:
            for call in delta_choice.delta.tool_calls or []:
                calls.setdefault(call.index, {"name": "", "arguments": ""})
                calls[call.index]["name"] += call.function.name or ""
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = delta_choice.finish_reason or finish
    expected = plain.choices[0].message.tool_calls[0].function
    assert calls == {0: {"name": expected.name, "arguments": expected.arguments}}
    assert finish == "tool_calls"
    assert usage.completion_tokens * 2 == plain.usage.completion_tokens


def test_openai_stream_sends_the_answer_as_it_is_generated(gateway):
    """Streamed, the answer comes as several content deltas (one per engine chunk that settles more text); joined
    they are the plain answer, and the session trains the same engine tokens, log-probs included."""
    gw, proxy = gateway
    messages = [{"role": "user", "content": QUESTION}, *CALCULATOR_CONVERSATION["messages"][1:3]]
    plain_session, streamed_session = gw.open(), gw.open()
    plain = openai_client(gw, plain_session.key).chat.completions.create(
        model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0)
    start = len(proxy.generated)
    stream = openai_client(gw, streamed_session.key).chat.completions.create(
        model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0, stream=True, logprobs=True,
        stream_options={"include_usage": True})
    deltas, finish, usage, logprobs = [], None, None, []
    for chunk in stream:
        usage = chunk.usage or usage
        for delta_choice in chunk.choices:
            deltas += [delta_choice.delta.content] if delta_choice.delta.content else []
            logprobs += [c.logprob for c in (delta_choice.logprobs.content or [])] if delta_choice.logprobs else []
            finish = delta_choice.finish_reason or finish
    assert plain.choices[0].message.content == "The answer is 5."
    assert len(deltas) > 1 and "".join(deltas) == plain.choices[0].message.content
    assert finish == "stop" and usage.completion_tokens == plain.usage.completion_tokens
    [(inputs, outputs, engine_logprobs)] = engine_turns(proxy, start)
    assert logprobs == engine_logprobs
    trained = sample_tokens(streamed_session.trajectory.tip)
    assert trained.tokens == inputs + outputs == sample_tokens(plain_session.trajectory.tip).tokens
    assert trained.rollout_log_probs == engine_logprobs and trained.loss_mask == [1] * len(outputs)


def test_anthropic_tool_use_then_answer_plain_and_streamed(gateway):
    gw, proxy = gateway
    session = gw.open()
    client = anthropic_client(gw, session.key)
    start = len(proxy.generated)
    messages = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(model="m", max_tokens=120, messages=messages, tools=[ANTHROPIC_TOOL])
    assert first.stop_reason == "tool_use"
    use = next(block for block in first.content if block.type == "tool_use")
    assert use.name == "calculator" and use.input == {"expression": "2+3"}
    messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    with client.messages.stream(model="m", max_tokens=120, messages=messages, tools=[ANTHROPIC_TOOL]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == "The answer is 5." and final.stop_reason == "end_turn"
    (in1, out1, _), (in2, out2, _) = engine_turns(proxy, start)
    usage = final.usage  # Anthropic's three input counts add up to the prompt
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == len(in2)
    assert final.usage.output_tokens == len(out2)
    assert in2[:len(in1) + len(out1)] == in1 + out1
    assert sample_tokens(session.trajectory.tip).tokens == in2 + out2
    assert session.trajectory.branches == []


def engine_cached(proxy: EngineProxy, since: int) -> list[int]:
    """meta_info.cached_tokens of each /generate the engine answered since record `since` (a stream's last chunk)."""
    return [reply["meta_info"]["cached_tokens"] for _, reply in proxy.since(since)]


def test_a_sessions_second_turn_reports_the_engines_cached_tokens_in_each_api(gateway):
    """The engine holds the first turn's tokens in its prefix cache: the second turn's usage says how many of its
    prompt tokens the engine found there, as each API reports it (Anthropic's input_tokens are the rest)."""
    gw, proxy = gateway
    first_messages = [{"role": "user", "content": QUESTION}]

    def anthropic_turns(stream: bool):
        client = anthropic_client(gw, gw.open().key)
        first = client.messages.create(model="m", max_tokens=120, messages=first_messages, tools=[ANTHROPIC_TOOL])
        use = next(block for block in first.content if block.type == "tool_use")
        messages = [*first_messages, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
        start = len(proxy.generated)
        if not stream:
            return client.messages.create(model="m", max_tokens=120, messages=messages, tools=[ANTHROPIC_TOOL]), \
                None, start
        with client.messages.stream(model="m", max_tokens=120, messages=messages, tools=[ANTHROPIC_TOOL]) as events:
            started = next(e for e in events if e.type == "message_start")
            final = events.get_final_message()
        return final, started.message.usage, start

    for stream in (False, True):
        second, started, start = anthropic_turns(stream)
        [(in2, out2, _)], [cached] = engine_turns(proxy, start), engine_cached(proxy, start)
        assert cached > 0, cached
        usage = second.usage
        assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (cached, 0), (stream, usage)
        assert (usage.input_tokens, usage.output_tokens) == (len(in2) - cached, len(out2)), (stream, usage)
        if started is not None:  # message_start already carries the prompt's counts
            assert (started.input_tokens, started.cache_read_input_tokens) == (len(in2) - cached, cached), started

    client = openai_client(gw, gw.open().key)
    first = client.chat.completions.create(model="m", messages=first_messages, tools=[OPENAI_TOOL], temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*first_messages, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    start = len(proxy.generated)
    second = client.chat.completions.create(model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0)
    [cached] = engine_cached(proxy, start)
    assert cached > 0 and second.usage.prompt_tokens_details.cached_tokens == cached, second.usage

    client = openai_client(gw, gw.open().key)
    first = client.responses.create(model="m", input=QUESTION, tools=[RESPONSES_TOOL], temperature=0)
    call = next(item for item in first.output if item.type == "function_call")
    start = len(proxy.generated)
    second = client.responses.create(model="m", previous_response_id=first.id, tools=[RESPONSES_TOOL], temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    [cached] = engine_cached(proxy, start)
    assert cached > 0 and second.usage.input_tokens_details.cached_tokens == cached, second.usage


def metric(gateway: GatewayThread, name: str) -> float:
    lines = httpx.get(f"{gateway.url}/metrics", timeout=30.0).text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))


def test_edited_history_starts_a_reported_branch(gateway):
    gw, proxy = gateway
    branches_before = metric(gw, "physarum_gateway_branches_total")
    session = gw.open()
    client = openai_client(gw, session.key)
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[OPENAI_TOOL], temperature=0)
    edited = first.choices[0].message.model_dump(exclude_none=True)
    edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"expression": "2+4"})
    start = len(proxy.generated)
    client.chat.completions.create(model="m", max_tokens=4, tools=[OPENAI_TOOL], temperature=0, messages=[
        *messages, edited, {"role": "tool", "tool_call_id": "x", "content": "6"}])
    state = httpx.get(f"{gw.url}/v1/session", headers={"Authorization": f"Bearer {session.key}"}).json()
    assert state["branches"] == [{"turn": 1, "reason": "the history repeats no turn the gateway produced"}]
    assert metric(gw, "physarum_gateway_branches_total") == branches_before + 1
    (in2, out2, _), = engine_turns(proxy, start)
    # a branch is a fresh prompt: the edited call is rendered as text and trains nothing
    trained = sample_tokens(session.trajectory.tip)
    assert trained.tokens == in2 + out2 and trained.response_length == len(out2)
    assert '"2+4"' in gw.encoder.decode(in2, skip_special_tokens=False)


def test_keys_and_bounds_answer_4xx(gateway):
    gw, _ = gateway
    session = gw.open()
    client = openai_client(gw, session.key)
    with pytest.raises(openai.AuthenticationError):
        openai_client(gw, "sk-wrong").chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])
    with pytest.raises(openai.BadRequestError, match="at most 4 per request"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}],
                                       tools=[OPENAI_TOOL] * 5)
    with pytest.raises(openai.BadRequestError, match=r"n must be in \[1, 2\]"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}], n=3)
    with pytest.raises(openai.APIStatusError, match="request body") as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (70 << 10)}])
    assert err.value.status_code == 413
    with pytest.raises(anthropic.BadRequestError, match="block type 'image'"):
        anthropic_client(gw, session.key).messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    gw.close_session(session)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])


def test_calculator_agent_ends_its_episode_when_a_tool_result_spends_the_budget(gateway):
    from examples.agent.calculator import agent

    gw, proxy = gateway
    messages = [{"role": "user", "content": QUESTION}]
    before = gw.encoder.render_messages(messages, [OPENAI_TOOL], add_generation_prompt=True)
    done = gw.encoder.render_messages(CALCULATOR_CONVERSATION["messages"][:2], [OPENAI_TOOL],
                                      add_generation_prompt=False)
    num_call_tokens = len(gw.encoder.encode_text(done[len(before):].removesuffix("\n")))
    # room for the warmed-up calculator call, not for its result's turn after it
    session = gw.open(max_new_tokens=num_call_tokens + 2)
    start = len(proxy.generated)
    prompt = {"prompt": QUESTION, "messages": [], "label": "5", "metadata": {}}
    assert asyncio.run(asyncio.wait_for(agent(f"{gw.url}/v1", session.key, prompt), TIMEOUT_S)) is None
    assert len(engine_turns(proxy, start)) == 1 and session.num_turns == 1  # the call; the answer was refused
    assert session.trajectory.tip.generated[-1] == gw.encoder.tokenizer.token_to_id("<|im_end|>")
    gw.close_session(session)
