"""Responses API input as the gateway's conversation: items become template messages (an assistant message and the
function calls after it one assistant turn, a call's output a tool message), after the stored history."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.rollout.gateway.conversation import Limits, assistant_message, from_responses, message_key

TOOL = {"type": "function", "name": "calculator", "parameters": {"type": "object"}}


def test_items_become_template_messages_after_the_history():
    history = [{"role": "user", "content": "2+3?"}]
    body = {"instructions": "Be brief.", "tools": [TOOL], "input": [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "call_1", "name": "calculator", "arguments": '{"expression": "2+3"}'},
        {"type": "function_call", "call_id": "call_2", "name": "calculator", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "0"}]},
        {"role": "developer", "content": "Answer now."}]}
    conversation = from_responses(body, Limits(), history)
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant", "tool", "tool", "system"]
    produced = assistant_message("Let me see.", [("calculator", {"expression": "2+3"}, "x"), ("calculator", {}, "y")])
    assert message_key(conversation.messages[2]) == message_key(produced)  # the turn the gateway produced
    assert conversation.messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    assert conversation.messages[4]["content"] == "0"
    assert conversation.tools == [{"type": "function", "function": {"name": "calculator", "description": "",
                                                                     "parameters": {"type": "object"}}}]
    assert history == [{"role": "user", "content": "2+3?"}]  # the stored history is not changed


def test_a_string_input_is_one_user_message():
    conversation = from_responses({"input": "hi"}, Limits(), [])
    assert conversation.messages == [{"role": "user", "content": "hi"}] and conversation.tools == []


@pytest.mark.parametrize("body, match", [
    ({"input": []}, "input: must not be empty"),
    ({"input": [{"type": "reasoning"}]}, "item type 'reasoning' is not supported"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "only function tools"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "is not JSON"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "'input_image'"),
    ({"input": "x", "tools": [TOOL] * 3}, "at most 2 per request"),
])
def test_unsupported_input_is_refused_naming_it(body, match):
    with pytest.raises(InvalidArgument, match=match):
        from_responses(body, Limits(max_tools=2), [])


def test_codexs_request_fields_are_accepted():
    """What Codex sends beside its input (its per-turn client_metadata, reasoning summary, encrypted-reasoning
    include, prompt cache key, store: false) parses and sets nothing the gateway samples with."""
    import json

    from services.rollout.gateway import responses_api, schema

    body = {"model": "m", "input": "hi", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k", "client_metadata": {"x-codex-turn-metadata": "{}", "thread_id": "t"}}
    parsed = schema.parse(json.dumps(body).encode(), schema.OPENAI_RESPONSES)
    params = responses_api.params(parsed)
    assert (params.max_tokens, params.temperature, params.top_p) == (None, None, None)


def test_input_image_parts_are_images_after_the_historys_own():
    from services.common.images import check_image
    from testkit.images import data_url, png

    red, blue = png(8, 8, (255, 0, 0)), png(8, 8, (0, 0, 255))
    first = from_responses({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(red), "detail": "auto"},
        {"type": "input_text", "text": "which color?"}]}]}, Limits(), [])
    assert [i.data for i in first.images] == [red]
    assert first.messages[0]["content"][0]["type"] == "image"
    assert first.messages[0]["content"][1] == {"type": "text", "text": "which color?"}
    history = [*first.messages, {"role": "assistant", "content": "red"}]
    later = from_responses({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "and?"}, {"type": "input_image", "image_url": data_url(blue)}]}]},
        Limits(), history, [check_image(red)])
    assert [i.data for i in later.images] == [red, blue]  # in the order their parts stand in the messages
    with pytest.raises(InvalidArgument, match=r"input\[0\]\.content\[0\] 'input_image': image URL "
                                              r"'https://example\.com/x\.png': only data: URLs are taken"):
        from_responses({"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/x.png"}]}]}, Limits(), [])
    with pytest.raises(InvalidArgument, match="needs image_url.*file_id is not supported"):
        from_responses({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
                       Limits(), [])
    with pytest.raises(InvalidArgument, match="2 images, at most 1 per request"):
        from_responses({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(blue)}]}]},
                       Limits(max_images=1), history, [check_image(red)])
