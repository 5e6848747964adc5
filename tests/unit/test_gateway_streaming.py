"""A streamed gateway turn without sockets: the content deltas sent while the text grows (held back at outer
whitespace, stop strings, tool calls and unfinished characters) and the streamed /generate client (chunks, retries
before the first chunk, none after)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.common.errors import InvalidArgument, Unavailable
from services.common.plugin_sample import START_VERSION_KEY
from services.rollout.engine_calls.generate import GenerateContext, stream_generate
from services.rollout.engine_calls.router_http import HttpxPoster
from services.rollout.gateway.deltas import ContentDeltas


def feed(deltas: ContentDeltas, texts: list[str]) -> list[str]:
    return [deltas.update(text) for text in texts]


def test_deltas_hold_back_outer_whitespace_stop_strings_and_tool_calls():
    plain = ContentDeltas(stop=["END"], with_tools=False)
    assert feed(plain, ["  ", "  Hi", "  Hi ", "  Hi th", "  Hi thE", "  Hi thEN", "  Hi thENd"]) == [
        "", "Hi", "", " th", "", "", "ENd"]  # "E", "EN" might begin "END"; "ENd" does not
    assert plain.finish("Hi thENd") == ""
    stopped = ContentDeltas(stop=["END"], with_tools=False)
    assert feed(stopped, ["a", "a E", "a END"]) == ["a", "", ""] and stopped.finish("a") == ""
    tools = ContentDeltas(stop=[], with_tools=True)
    assert feed(tools, ["Let me", "Let me <tool", "Let me <tool_call>{\"name\""]) == ["Let me", "", ""]
    assert tools.finish("Let me") == ""
    unfinished = ContentDeltas(stop=[], with_tools=False)
    assert feed(unfinished, ["caf\ufffd", "café"]) == ["caf", "é"]
    short = ContentDeltas(stop=[], with_tools=False)
    assert feed(short, ["The answer is", "The answer is 5.  "]) == ["The answer is", " 5."]
    assert short.finish("The answer is 5.") == ""


def chunk(ids: list[int], finish: dict | None) -> str:
    return "data: " + json.dumps({"text": "", "output_ids": ids, "meta_info": {
        "finish_reason": finish, "output_token_logprobs": [[-0.5, i, None] for i in ids]}}) + "\n\n"


def context(handler, **overrides) -> GenerateContext:
    http = HttpxPoster(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    return GenerateContext(**{"http": http, "router_url": "http://router", "name": "gateway", "rid_prefix": "gw",
                              "retry_delay_s": 0.0, "max_attempts": 3, **overrides})


async def collect(ctx: GenerateContext) -> list[dict]:
    try:
        return [c async for c in stream_generate(ctx, "turn 0", {"input_ids": [1], "sampling_params": {}})]
    finally:
        await ctx.http.aclose()


def test_stream_generate_yields_chunks_and_retries_only_before_the_first():
    bodies = []
    events = chunk([7], None) + chunk([7, 8], {"type": "stop"}) + "data: [DONE]\n\n"
    answers = [httpx.Response(503, text="no workers"), httpx.Response(200, text=events)]

    def handler(request):
        bodies.append(json.loads(request.content))
        return answers.pop(0)

    chunks = asyncio.run(collect(context(handler, version_now=lambda: "3")))
    assert [c["output_ids"] for c in chunks] == [[7], [7, 8]] and chunks[-1]["meta_info"][START_VERSION_KEY] == "3"
    assert [b["stream"] for b in bodies] == [True, True] and bodies[0]["rid"] != bodies[1]["rid"]
    with pytest.raises(InvalidArgument, match="rejected /generate: HTTP 400"):
        asyncio.run(collect(context(lambda request: httpx.Response(400, text="bad"))))
    with pytest.raises(Unavailable, match="failed 3 times"):
        asyncio.run(collect(context(lambda request: httpx.Response(502, text="bad gateway"))))
    error = chunk([7], None) + 'data: {"error": {"message": "boom"}}\n\n'
    with pytest.raises(InvalidArgument, match="ended the stream"):
        asyncio.run(collect(context(lambda request: httpx.Response(200, text=error))))

