"""The gateway's domain code without sockets: tool-call parsing, both APIs' messages as one conversation, and the
trajectory's matching (what is appended, what branches), on a character renderer whose tokens are code points."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.common.errors import InvalidArgument, Unavailable
from services.common.plugin_sample import PluginSample
from services.common.samples import Status
from services.rollout.engine_calls.generate import GenerateContext
from services.rollout.engine_calls.router_http import HttpxPoster
from services.rollout.gateway.conversation import Conversation, Limits, assistant_message, from_anthropic, from_openai
from services.rollout.gateway.sessions import SessionRegistry, TurnParams
from services.rollout.gateway.toolcalls import parse_tool_calls
from services.rollout.gateway.trajectory import Trajectory, sample_tokens
from services.rollout.generation.agents import session_sample

END = "\x01"  # the end-of-turn "token" of the renderer below


class CharRenderer:
    """<role>:content END newline per message; a generation prompt 'assistant:'."""

    def render_messages(self, messages, tools=None, add_generation_prompt=True):
        text = "".join(f"{m['role']}:{m['content']}{END}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")

    def encode_text(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def turn(trajectory: Trajectory, messages: list[dict], reply: str, finish: str = "stop") -> tuple:
    conversation = Conversation(messages, [])
    prepared = trajectory.prepare(conversation)
    generated = [ord(c) for c in reply]
    trajectory.record(prepared, conversation, assistant_message(reply.removesuffix(END), []), generated,
                      [-0.5] * len(generated), ["3"], finish, make_tip=True)
    return prepared, {"role": "assistant", "content": reply.removesuffix(END)}


def test_a_continued_history_appends_only_the_closing_and_the_new_messages():
    trajectory = Trajectory(CharRenderer())
    user = {"role": "user", "content": "hi"}
    first, reply = turn(trajectory, [user], "yo" + END)
    assert first.branch_reason == "" and first.parent is None
    second, _ = turn(trajectory, [user, reply, {"role": "user", "content": "and?"}], "ok" + END)
    # the engine stopped at END: only the newline after it and the new message are added
    assert "".join(map(chr, second.context)) == "\nuser:and?\x01\nassistant:"
    trained = sample_tokens(trajectory.tip)
    prompt = "user:hi\x01\nassistant:"
    assert "".join(map(chr, trained.tokens)) == prompt + "yo\x01" + "\nuser:and?\x01\nassistant:" + "ok\x01"
    assert trained.loss_mask == [1] * 3 + [0] * len(second.context) + [1] * 3
    assert trained.rollout_log_probs == [-0.5] * 3 + [0.0] * len(second.context) + [-0.5] * 3
    assert trained.weight_versions == ["3"] and trajectory.branches == []


def test_a_turn_cut_by_length_gets_the_whole_closing():
    trajectory = Trajectory(CharRenderer())
    user = {"role": "user", "content": "hi"}
    _, reply = turn(trajectory, [user], "yo", finish="length")
    second, _ = turn(trajectory, [user, reply, user], "k" + END)
    assert "".join(map(chr, second.context)).startswith(END + "\nuser:")


def test_dropping_or_editing_turns_is_a_reported_branch():
    trajectory = Trajectory(CharRenderer())
    user = {"role": "user", "content": "hi"}
    _, first = turn(trajectory, [user], "a" + END)
    _, second = turn(trajectory, [user, first, user], "b" + END)
    dropped, _ = turn(trajectory, [user, first, {"role": "user", "content": "other"}], "c" + END)
    assert dropped.parent is trajectory.turns[0] and dropped.branch_reason == "continues turn 0, not the last turn 1"
    edited, _ = turn(trajectory, [user, {"role": "assistant", "content": "edited"}, user], "d" + END)
    assert edited.parent is None and edited.branch_reason == "the history repeats no turn the gateway produced"
    assert [b.turn for b in trajectory.branches] == [2, 3]
    assert sample_tokens(trajectory.tip).response_length == 2  # the branch's prompt is new: only "d" END trains


def test_tool_calls_are_parsed_from_hermes_blocks():
    text = ('Let me see.<tool_call>\n{"name": "calc", "arguments": {"x": "1+2"}}\n</tool_call>'
            '<tool_call>{"name": "calc", "arguments": "{\\"x\\": 3}"}</tool_call>'
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call><tool_call>not json</tool_call>')
    content, calls = parse_tool_calls(text, {"calc"})
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"x": "1+2"}), ("calc", {"x": 3})]
    assert content == ('Let me see.<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
                       '<tool_call>not json</tool_call>')
    assert calls[0].id != calls[1].id


def test_anthropic_and_openai_histories_are_one_conversation():
    tool = {"name": "calc", "description": "d", "input_schema": {"type": "object"}}
    anthropic = from_anthropic({"system": "s", "tools": [tool], "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "t"},
                                          {"type": "tool_use", "id": "u1", "name": "calc", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u1", "content": "1"}]}]}, Limits())
    openai = from_openai({"tools": [{"type": "function", "function": {"name": "calc", "description": "d",
                                                                      "parameters": {"type": "object"}}}],
                          "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "t", "tool_calls": [
                                           {"id": "c9", "type": "function",
                                            "function": {"name": "calc", "arguments": '{"x": 1}'}}]},
                                       {"role": "tool", "tool_call_id": "c9", "content": "1"}]}, Limits())
    assert anthropic.keys() == openai.keys() and anthropic.tools_key() == openai.tools_key()


def test_requests_past_their_bounds_are_refused():
    with pytest.raises(InvalidArgument, match="at most 2 per request"):
        from_openai({"messages": [{"role": "user", "content": "x"}] * 3}, Limits(max_messages=2))
    with pytest.raises(InvalidArgument, match="not JSON"):
        from_openai({"messages": [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{"}}]}]}, Limits())
    with pytest.raises(InvalidArgument, match="role must be"):
        from_openai({"messages": [{"role": "robot", "content": "x"}]}, Limits())


def test_a_turn_of_an_aborted_rollout_answers_503_and_its_sample_is_aborted():
    sent = []

    def router(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    async def main() -> None:
        ctx = GenerateContext(http=HttpxPoster(httpx.AsyncClient(transport=httpx.MockTransport(router))),
                              router_url="http://router", name="rollout 0 of job j", rid_prefix="j-0", aborting=True)
        registry = SessionRegistry()
        session = registry.open(ctx, CharRenderer(), {"max_new_tokens": 8}, session_id="s")
        with pytest.raises(Unavailable, match="aborted"):
            await session.turn(Conversation([{"role": "user", "content": "hi"}], []), TurnParams())
        registry.close(session)
        assert session.aborted and not sent and len(registry) == 0
        assert session_sample(PluginSample(tokens=[1]), session, None, False, "t").status == Status.ABORTED

    asyncio.run(main())


def test_a_history_that_re_renders_differently_continues_the_gateways_own_turns():
    """Whitespace, re-serialized tool arguments and a moved system prompt: the match is on the canonical history,
    and what is new is rendered after the messages the gateway holds, so no generated token changes."""
    trajectory = Trajectory(CharRenderer())
    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "what is  1+2?"}
    conversation = from_openai({"messages": [system, user], "tools": [{"type": "function", "function": {
        "name": "calc", "parameters": {"type": "object"}}}]}, Limits())
    prepared = trajectory.prepare(conversation)
    produced = assistant_message("", [("calc", {"x": "1+2", "y": 1}, "call_1")])
    trajectory.record(prepared, conversation, produced, [ord(c) for c in "C" + END], [-0.1, -0.2], [], "stop", True)
    sent_back = {"role": "assistant", "content": "\n", "tool_calls": [
        {"id": "other-id", "type": "function", "function": {"name": "calc", "arguments": '{"y":1,  "x":"1+2"}'}}]}
    again = from_openai({"messages": [{"role": "user", "content": " what is 1+2?\n"}, sent_back,
                                      {"role": "tool", "tool_call_id": "other-id", "content": "3"}, system],
                         "tools": conversation.tools}, Limits())
    second = trajectory.prepare(again)
    assert second.parent is trajectory.turns[0] and second.branch_reason == ""
    assert "".join(map(chr, second.context)) == "\ntool:3\x01\nassistant:"
    assert second.input_ids == [*trajectory.turns[0].tokens(), *second.context]
    # the new messages follow the gateway's copy of the history: the system first, the user's text as first sent
    assert second.messages[:2] == [system, user] and second.messages[3]["role"] == "tool"
    changed = from_openai({"messages": [{"role": "user", "content": "what is 1+3?"}, sent_back], "tools":
                           conversation.tools}, Limits())
    assert trajectory.prepare(changed).parent is None  # a different text is not whitespace


def test_spawned_sessions_are_bounded_and_close_with_the_first():
    from services.common.errors import FailedPrecondition, NotFound

    registry = SessionRegistry(Limits(max_spawned=2))
    ctx = GenerateContext(http=None, router_url="http://router", name="rollout 0 of job j", rid_prefix="j-0")
    root = registry.open(ctx, CharRenderer(), {"max_new_tokens": 8}, session_id="s")
    first = registry.spawn(root)
    second = registry.spawn(first)  # a sub-agent's sub-agent is the sample's too
    assert (first.id, second.id, root.children) == ("s-1", "s-2", [first, second])
    assert first.key != root.key and registry.by_key(second.key) is second and len(registry) == 3
    with pytest.raises(InvalidArgument, match="2 sessions spawned, at most 2 per sample"):
        registry.spawn(root)
    registry.close(root)
    assert len(registry) == 0 and first.closed and second.closed
    with pytest.raises(NotFound):
        registry.by_key(first.key)
    with pytest.raises(FailedPrecondition, match="has ended"):
        registry.spawn(first)


def test_an_image_for_a_text_model_is_refused_and_images_are_bounded_per_request():
    import base64
    import io

    from PIL import Image as PILImage

    out = io.BytesIO()
    PILImage.new("RGB", (8, 8), (255, 0, 0)).save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "hi"}]}]}
    conversation = from_openai(body, Limits())
    assert [image.mime_type for image in conversation.images] == ["image/png"]
    assert conversation.messages[0]["content"][0]["type"] == "image"
    with pytest.raises(InvalidArgument, match="1 images, but the model is a text model"):
        Trajectory(CharRenderer()).prepare(conversation)
    with pytest.raises(InvalidArgument, match="2 images, at most 1 per request"):
        from_openai({"messages": [{**body["messages"][0]}, {**body["messages"][0]}]}, Limits(max_images=1))


def test_a_tool_results_images_are_images_in_the_order_of_the_messages():
    """A computer-use tool returns a screenshot: an Anthropic tool_result with an image block (and a Responses
    function_call_output with an input_image part) is a tool message with an image part; the conversation's
    images follow the messages' order (the tool message comes before the user's text of the same turn)."""
    from services.rollout.gateway.conversation import from_responses
    from testkit.images import data_url, png

    red, blue = png(8, 8, (255, 0, 0)), png(8, 8, (0, 0, 255))
    block = lambda data: {"type": "image", "source": {"type": "base64", "media_type": "image/png",  # noqa: E731
                                                      "data": data_url(data).split(",")[1]}}
    conversation = from_anthropic({"messages": [
        {"role": "user", "content": "click the button"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "click", "input": {"x": 1}}]},
        {"role": "user", "content": [block(blue), {"type": "text", "text": "and now?"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": [
                                         {"type": "text", "text": "clicked"}, block(red)]}]}]}, Limits())
    tool, user = conversation.messages[2:]
    assert tool["role"] == "tool" and [p["type"] for p in tool["content"]] == ["text", "image"]
    assert user["role"] == "user" and [p["type"] for p in user["content"]] == ["image", "text"]
    assert [i.data for i in conversation.images] == [red, blue]  # the tool message's first, as rendered
    with pytest.raises(InvalidArgument, match=r"messages\[0\]\.content\[0\]\.content\[0\]: corrupt image"):
        from_anthropic({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                   "content": [block(red[:20])]}]}]}, Limits())
    responses = from_responses({"input": [
        {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": data_url(red)}, {"type": "input_text", "text": "the screen"}]}]},
        Limits(), [{"role": "user", "content": "look"}])
    assert [p["type"] for p in responses.messages[-1]["content"]] == ["image", "text"]
    assert [i.data for i in responses.images] == [red]
    with pytest.raises(InvalidArgument, match=r"input\[1\]\.output\[0\] 'input_image': image URL"):
        from_responses({"input": [
            {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_image", "image_url": "https://example.com/s.png"}]}]}, Limits(), [])
