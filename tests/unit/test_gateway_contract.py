"""The gateway's input contract, over its real app without sockets: hostile bodies of each API answer 4xx in the
API's error shape naming the field (never 500, never RecursionError), a message past the model's context is refused
before it is tokenized whole, and errors from the engines' side name no internal address or job."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from physarum import tasks, tinymodel
from services.rollout.engine_calls.generate import GenerateContext, sampling_params
from services.rollout.engine_calls.router_http import AiohttpPoster
from services.rollout.gateway import schema
from services.rollout.gateway.app import create_app
from services.rollout.gateway.sessions import SessionRegistry
from services.rollout.gateway.trajectory import COUNT_CHUNK_CHARS
from services.rollout.generation.prompts import PromptEncoder

ROUTER = "http://127.0.0.1:9"  # nothing listens: a turn that gets as far as the router fails there
JOB = "job-secret-7f3a"
USER = [{"role": "user", "content": "1+1"}]


class CountingEncoder(PromptEncoder):
    """The real encoder, remembering the longest text it was asked to tokenize."""

    longest = 0

    def encode_text(self, text: str) -> list[int]:
        self.longest = max(self.longest, len(text))
        return super().encode_text(text)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> CountingEncoder:
    out = tmp_path_factory.mktemp("tokenizer")
    tinymodel.build_tokenizer(tasks.corpus(), out)
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    return CountingEncoder(out)


def post_all(encoder: PromptEncoder, requests: list[tuple[str, bytes]]) -> list[httpx.Response]:
    """Each (path, body) posted in order with one session's key."""

    async def run() -> list[httpx.Response]:
        registry = SessionRegistry(workers=2)
        http = AiohttpPoster(4, 5.0)
        ctx = GenerateContext(http=http, router_url=ROUTER, name=JOB, rid_prefix=JOB, max_attempts=1,
                              retry_delay_s=0.0)
        params = sampling_params(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=8, stop=[], stop_token_ids=[])
        session = registry.open(ctx, encoder, params, session_id="s1")
        transport = httpx.ASGITransport(app=create_app(registry))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client:
                return [await client.post(path, content=body, headers={"authorization": f"Bearer {session.key}",
                                                                        "content-type": "application/json"})
                        for path, body in requests]
        finally:
            await http.aclose()
            registry.pool.shutdown()

    return asyncio.run(run())


def openai_body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


def anthropic_body(**fields) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 4, "messages": USER, **fields}).encode()


DEEP = b'{"model": "m", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
SURROGATE = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'

OPENAI_CASES = [  # (body, the param the error names)
    (openai_body(messages=[{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": "calculator"}]}]), "messages[0].tool_calls[0].function"),
    (openai_body(stop=5), "stop"),
    (openai_body(stream=True, stream_options=["include_usage"]), "stream_options"),
    (openai_body(temperature=float("nan")), None),
    (openai_body(temperature="hot"), "temperature"),
    (openai_body(max_tokens=0), "max_tokens"),
    (openai_body(n=True), "n"),
    (openai_body(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (openai_body(messages=[{"role": "user", "content": {"text": "x"}}]), "messages[0].content"),
    (openai_body(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools[0].function.parameters"),
    (openai_body(frobnicate=1), "frobnicate"),
    (openai_body(messages="hello"), "messages"),
    (openai_body(metadata={"a": [[[[]]]]}, tool_choice=7), "tool_choice"),
    (b"[1, 2]", None),
    (b"{not json", None),
    (DEEP, None),
    (SURROGATE, "messages[0].content"),
]
ANTHROPIC_CASES = [
    (anthropic_body(thinking="on"), "thinking"),
    (anthropic_body(tool_choice="none"), "tool_choice"),
    (anthropic_body(system=[{"type": "text", "text": 5}]), "system[0].text"),
    (anthropic_body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                            "content": {"x": 1}}]}]), "messages[0].content[0].content"),
    (anthropic_body(stop_sequences="END"), "stop_sequences"),
    (anthropic_body(metadata="me"), "metadata"),
    (anthropic_body(output_config={"effort": 3}), "output_config.effort"),
    (anthropic_body(unknown_field=True), "unknown_field"),
    (json.dumps({"model": "m", "messages": USER}).encode(), "max_tokens"),
    (DEEP, None),
    (SURROGATE.replace(b'"messages"', b'"max_tokens": 4, "messages"'), "messages[0].content"),
]


def test_hostile_bodies_of_both_apis_answer_400_in_the_apis_shape_naming_the_field(encoder):
    requests = [("/v1/chat/completions", body) for body, _ in OPENAI_CASES]
    requests += [("/v1/messages", body) for body, _ in ANTHROPIC_CASES]
    replies = post_all(encoder, requests)
    for (body, param), reply in zip(OPENAI_CASES, replies[:len(OPENAI_CASES)], strict=True):
        assert reply.status_code == 400, (body[:80], reply.text[:300])
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param, (body[:80], error)
    for (body, param), reply in zip(ANTHROPIC_CASES, replies[len(OPENAI_CASES):], strict=True):
        assert reply.status_code == 400, (body[:80], reply.text[:300])
        data = reply.json()
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
        assert param is None or data["error"]["message"].startswith(f"{param}:"), (param, data)


def responses_body(**fields) -> bytes:
    return json.dumps({"model": "m", "input": "1+1", **fields}).encode()


RESPONSES_CASES = [  # (body, the param the error names)
    (responses_body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"x": 1}}]),
     "input[0].arguments"),
    (responses_body(input=[{"role": "wizard", "content": "x"}]), "input[0].role"),
    (responses_body(input=[{"type": "function_call_output", "call_id": "c", "output": 5}]), "input[0].output"),
    (responses_body(input=[{"role": "user", "content": [{"text": "x"}]}]), "input[0].content[0].type"),
    (responses_body(input=7), "input"),
    (json.dumps({"model": "m"}).encode(), "input"),
    (responses_body(tools=[{"type": "function", "name": "f", "parameters": "{}"}]), "tools[0].parameters"),
    (responses_body(tools=[{"type": "web_search"}]), "tools[0].type"),
    (responses_body(temperature=float("nan")), None),
    (responses_body(max_output_tokens=0), "max_output_tokens"),
    (responses_body(previous_response_id=5), "previous_response_id"),
    (responses_body(previous_response_id="resp_nobody"), "previous_response_id"),
    (responses_body(tool_choice="required"), "tool_choice"),
    (responses_body(text={"format": {"type": "json_schema"}}), "text.format"),
    (responses_body(truncation="middle"), "truncation"),
    (responses_body(frobnicate=1), "frobnicate"),
    (responses_body(input=[{"type": "reasoning", "summary": []}]), "input[0].type"),
    (DEEP.replace(b'"messages"', b'"input"'), None),
    (SURROGATE.replace(b'"messages"', b'"input"'), "input[0].content"),
]


def test_hostile_responses_bodies_answer_400_in_openais_shape_naming_the_field(encoder):
    replies = post_all(encoder, [("/v1/responses", body) for body, _ in RESPONSES_CASES])
    for (body, param), reply in zip(RESPONSES_CASES, replies, strict=True):
        assert reply.status_code == 400, (body[:80], reply.text[:300])
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param, (body[:80], error)


def test_unknown_routes_answer_in_the_apis_shape(encoder):
    [openai_404, anthropic_405] = post_all(encoder, [("/v1/embeddings", b"{}"), ("/v1/messages/count", b"{}")])
    assert openai_404.status_code == 404 and openai_404.json()["error"]["type"] == "not_found_error"
    assert anthropic_405.status_code in (404, 405) and anthropic_405.json()["type"] == "error"


def test_a_message_past_the_context_is_refused_before_it_is_tokenized_whole(encoder):
    encoder.longest = 0
    huge = "12+34=46 " * (3_000_000 // 9)
    [reply] = post_all(encoder, [("/v1/chat/completions", openai_body(messages=[{"role": "user", "content": huge}]))])
    assert reply.status_code == 400 and "context" in reply.json()["error"]["message"], reply.text[:300]
    assert 0 < encoder.longest <= COUNT_CHUNK_CHARS


def test_engine_side_errors_name_no_internal_address_or_job(encoder):
    replies = post_all(encoder, [("/v1/chat/completions", openai_body()),
                                 ("/v1/chat/completions", openai_body(stream=True)),
                                 ("/v1/messages", anthropic_body())])
    assert [r.status_code for r in replies] == [503, 200, 503]  # the stream's headers went before the turn failed
    assert '"error"' in replies[1].text and "[DONE]" not in replies[1].text, replies[1].text
    for reply in replies:
        assert "127.0.0.1" not in reply.text and JOB not in reply.text and ROUTER not in reply.text, reply.text


def test_schema_walk_is_iterative_and_checks_every_string():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(schema.RequestInvalid, match="nested deeper"):
        schema.walk({"a": deep})
    with pytest.raises(schema.RequestInvalid, match="lone surrogate") as err:
        schema.walk({"a": [{"ok": "x", "\ud83d": 1}]})
    assert err.value.param == "a[0]"
    schema.walk({"a": [{"b": "é😀"}] * 3})  # valid text of any plane passes


def test_a_valid_body_of_each_api_passes_whole(tmp_path: Path):
    body = schema.parse(openai_body(stop="END", stream=True, stream_options={"include_usage": True}, tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], messages=[
        *USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "2"}]}]), schema.OPENAI_CHAT)
    assert body["stop"] == "END"
    schema.parse(responses_body(instructions="be brief", stream=True, store=False, tool_choice="auto", tools=[
        {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": None}], input=[
        {"role": "user", "content": [{"type": "input_text", "text": "1+1"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "c", "output": "2"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "2", "annotations": []}]}]),
        schema.OPENAI_RESPONSES)
    schema.parse(anthropic_body(system=[{"type": "text", "text": "be brief"}], tool_choice={"type": "auto"},
                                metadata={"user_id": "u"}, thinking={"type": "disabled"},
                                output_config={"effort": "high"}), schema.ANTHROPIC_MESSAGES)


def test_engine_side_errors_of_the_responses_api_name_no_internal_address_or_job(encoder):
    bodies = [json.dumps({"model": "m", "input": "1+1", "stream": stream}).encode() for stream in (False, True)]
    plain, streamed = post_all(encoder, [("/v1/responses", body) for body in bodies])
    assert (plain.status_code, plain.json()["error"]["type"]) == (503, "overloaded_error")
    assert streamed.status_code == 200  # the stream's headers went before the turn failed
    assert streamed.text.startswith("event: response.created") and "event: error" in streamed.text, streamed.text
    assert "response.completed" not in streamed.text
    for reply in (plain, streamed):
        assert "127.0.0.1" not in reply.text and JOB not in reply.text and ROUTER not in reply.text, reply.text


@pytest.mark.parametrize(("parameters", "param"), [
    ({"type": "banana"}, "tools[0].function.parameters.type"),
    ({"type": ["string", 3]}, "tools[0].function.parameters.type"),
    ({"type": "object", "properties": []}, "tools[0].function.parameters.properties"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": 5}}},
     "tools[0].function.parameters.properties.a.items"),
    ({"type": "object", "required": ["a", 1]}, "tools[0].function.parameters.required"),
    ({"anyOf": {"type": "string"}}, "tools[0].function.parameters.anyOf"),
    ({"enum": "ab"}, "tools[0].function.parameters.enum"),
])
def test_a_tool_schema_that_is_not_json_schema_is_refused_naming_where(parameters, param):
    from services.rollout.gateway.conversation import Limits, from_openai

    body = {"messages": [{"role": "user", "content": "q"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
    with pytest.raises(schema.RequestInvalid, match="not a JSON Schema") as err:
        from_openai(body, Limits())
    assert err.value.param == param
    good = {"type": "object", "properties": {"a": {"type": ["string", "null"], "enum": ["x", None]},
                                             "b": {"anyOf": [{"type": "integer"}, True]}}, "required": ["a"]}
    assert from_openai({**body, "tools": [{"type": "function", "function": {"name": "f", "parameters": good}}]},
                       Limits()).tools[0]["function"]["parameters"] == good
