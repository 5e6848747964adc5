"""slime.agent's tokenizer-free modules as slime's adapters and harnesses call them: parsing (model output into
reasoning, text and tool uses), trajectory (turns into loss-masked Samples) and adapters.common's helpers."""

from __future__ import annotations

import types

import pytest
from slime.agent.adapters.common import (
    flatten_content,
    manager_finish_reason,
    sid_from_bearer,
    sid_from_body,
    tool_call_dict,
)
from slime.agent.parsing import parse_model_output, parse_xml_tool_uses
from slime.agent.trajectory import TrajectoryManager, TurnRecord
from slime.utils.types import Sample

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
USER = {"role": "user", "content": "What is 2+3?"}


def test_parse_model_output_splits_reasoning_text_and_a_qwen_tool_call():
    raw = ('<think>add them</think>Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
           '{"expression": "2+3"}}\n</tool_call>')
    parsed = parse_model_output(raw, tools_schema=TOOLS, tool_parser_name="qwen25", reasoning_parser_name="qwen3")
    assert (parsed.reasoning, parsed.text) == ("add them", "Let me compute.")
    assert parsed.tool_uses == [{"name": "calculator", "input": {"expression": "2+3"}}] and not parsed.ill_formed
    plain = parse_model_output("The answer is 5.", tools_schema=TOOLS, tool_parser_name="qwen25",
                               reasoning_parser_name=None)
    assert (plain.text, plain.tool_uses) == ("The answer is 5.", [])
    with pytest.raises(ValueError, match="tool parser 'glm45' is not provided here"):
        parse_model_output(raw, tools_schema=TOOLS, tool_parser_name="glm45", reasoning_parser_name=None)


def test_parse_xml_tool_uses_takes_declared_tools_out_of_the_text():
    body = ("a<tool_call><function=calculator><parameter=expression> 2+3 </parameter></function></tool_call>b"
            "<tool_call><function=shell><parameter=cmd>ls</parameter></function></tool_call>")
    text, uses = parse_xml_tool_uses(body, TOOLS)
    assert uses == [{"name": "calculator", "input": {"expression": "2+3"}}]
    assert text == "ab<tool_call><function=shell><parameter=cmd>ls</parameter></function></tool_call>"


def turn(prompt, output, log_probs=None, finish="stop"):
    return TurnRecord(prompt_ids=prompt, output_ids=output, finish_reason=finish,
                      output_log_probs=log_probs or [-0.5] * len(output))


def test_two_clean_turns_make_one_sample_whose_tool_result_trains_nothing():
    manager = TrajectoryManager()
    call = {"role": "assistant", "content": "", "tool_calls": [tool_call_dict("calculator", {"expression": "2+3"})]}
    manager.record_turn("s", turn=turn([1, 2], [3, 4]), prompt_messages=[USER], response_message=call)
    manager.record_turn("s", turn=turn([1, 2, 3, 4, 9], [5, 6], [-0.1, -0.2]),
                        prompt_messages=[USER, call, {"role": "tool", "content": "5"}],
                        response_message={"role": "assistant", "content": "The answer is 5."})
    assert manager.has_session("s") and manager.turn_count("s") == 2
    (sample,) = manager.get_trajectory("s", base_sample=Sample(index=3, group_index=7, prompt="q"), reward=1.0,
                                       extra_metadata={"k": "v"})
    assert sample.tokens == [1, 2, 3, 4, 9, 5, 6] and sample.response_length == 5
    assert sample.loss_mask == [1, 1, 0, 1, 1] and sample.rollout_log_probs == [-0.5, -0.5, 0.0, -0.1, -0.2]
    assert (sample.reward, sample.index, sample.group_index, sample.status) == (1.0, 3, 7, Sample.Status.COMPLETED)
    assert sample.metadata == {"k": "v", "truncated": False, "use_tool": True, "ill_formed": False}
    assert manager.get_trajectory("s", base_sample=Sample()) == [] and not manager.has_session("s")


def test_drift_in_the_last_response_is_realigned_and_drift_before_it_forks():
    realigned = TrajectoryManager()
    first = {"role": "assistant", "content": "x"}
    realigned.record_turn("s", turn=turn([1, 2], [3, 4]), prompt_messages=[USER], response_message=first)
    # the replayed response re-tokenized as [3, 8]: its span is overwritten as context
    realigned.record_turn("s", turn=turn([1, 2, 3, 8, 9], [5]), prompt_messages=[USER, first, USER],
                          response_message={"role": "assistant", "content": "y"})
    (sample,) = realigned.get_trajectory("s", base_sample=Sample())
    assert sample.tokens == [1, 2, 3, 8, 9, 5] and sample.loss_mask == [0, 0, 0, 1]
    forked = TrajectoryManager()
    forked.record_turn("s", turn=turn([1, 2], [3, 4]), prompt_messages=[USER], response_message=first)
    forked.record_turn("s", turn=turn([1, 7, 3, 4, 9], [5]), prompt_messages=[USER, first, USER],
                       response_message={"role": "assistant", "content": "y"})
    samples = forked.get_trajectory("s", base_sample=Sample())
    assert [s.tokens for s in samples] == [[1, 2, 3, 4], [1, 7, 3, 4, 9, 5]]
    assert [s.loss_mask for s in samples] == [[1, 1], [1]]


def test_a_replayed_rewrite_of_a_short_response_replaces_it_and_sibling_branches_train_once():
    manager = TrajectoryManager(fork_threshold_tokens=4)
    manager.record_turn("s", turn=turn([1], [2]), prompt_messages=[USER],
                        response_message={"role": "assistant", "content": "a "})
    manager.record_turn("s", turn=turn([1, 2, 3], [4]), prompt_messages=[USER, {"role": "assistant", "content": "a"},
                                                                       USER],
                        response_message={"role": "assistant", "content": "b"})
    (sample,) = manager.get_trajectory("s", base_sample=Sample())  # the first turn is context now, not a branch
    assert sample.tokens == [1, 2, 3, 4] and sample.loss_mask == [1]
    siblings = TrajectoryManager()
    siblings.record_turn("s", turn=turn([1], [2]), prompt_messages=[USER], response_message={"role": "assistant"})
    for reply in (5, 6):
        siblings.record_turn("s", turn=turn([1, 2, reply], [reply + 10]),
                             prompt_messages=[USER, {"role": "assistant"}, {"role": "user", "content": str(reply)}],
                             response_message={"role": "assistant"})
    samples = siblings.get_trajectory("s", base_sample=Sample())
    assert [s.loss_mask for s in samples] == [[1, 0, 1], [0, 0, 1]]  # the shared first turn trains once


def test_adapters_common_helpers():
    assert flatten_content([{"type": "text", "text": "a"}, {"type": "tool_result", "content": [
        {"type": "text", "text": "5"}]}, {"type": "image"}]) == "a\n5\n[image omitted]"
    assert manager_finish_reason([{"name": "t"}], "stop") == "tool_calls" and manager_finish_reason([], "") == "stop"
    request = types.SimpleNamespace(headers={"Authorization": "Bearer sid-1"})
    assert sid_from_bearer(request) == "sid-1"
    assert sid_from_body({"metadata": {"session_id": "a"}, "user": "b"}) == "a" and sid_from_body({"user": "b"}) == "b"
