"""A gateway session's transcript for the dashboard: each turn's new messages and reply with its tool calls, which
turns the sample trains, branches; bounded; carried through the buffer's wire form (a protobuf Struct) to the
dashboard's board, which re-bounds it and serves it apart from the samples list."""

from __future__ import annotations

from services.common.samples import Sample, sample_from_proto, sample_to_proto
from services.rollout.gateway import transcript as transcript_module
from services.rollout.gateway.conversation import Conversation, assistant_message
from services.rollout.gateway.trajectory import Trajectory
from services.rollout.gateway.transcript import transcript
from services.trainer.driver import sample_board
from services.trainer.driver.sample_board import SampleBoard
from tests.unit.test_gateway_trajectory import END, CharRenderer

USER = {"role": "user", "content": "What is 2+3 and 4*5?"}
CALLS = [("calculator", {"expression": "2+3"}, "call_a"), ("calculator", {"expression": "4*5"}, "call_b")]


def produce(trajectory: Trajectory, messages: list[dict], reply: dict) -> dict:
    """Record the turn the engine produced for `messages` (its tokens: the reply's text as code points)."""
    conversation = Conversation(messages, [{"type": "function", "function": {"name": "calculator"}}])
    prepared = trajectory.prepare(conversation)
    generated = [ord(c) for c in (reply["content"] or "call") + END]
    trajectory.record(prepared, conversation, reply, generated, [-0.1] * len(generated), ["1"], "stop", True)
    return reply


def parallel_session() -> Trajectory:
    """Two calls in one turn, both results in the next request, the answer; then a request that repeats only the
    first message (a branch)."""
    trajectory = Trajectory(CharRenderer())
    calls = produce(trajectory, [USER], assistant_message("", CALLS))
    results = [{"role": "tool", "tool_call_id": "call_a", "content": "5"},
               {"role": "tool", "tool_call_id": "call_b", "content": "20"}]
    produce(trajectory, [USER, calls, *results], assistant_message("5 and 20.", []))
    produce(trajectory, [USER, {"role": "user", "content": "again?"}], assistant_message("no", []))
    return trajectory


def test_each_turn_shows_its_new_messages_its_reply_and_whether_it_is_trained():
    trajectory = parallel_session()
    shown = transcript(trajectory, "s1", spawned=["s1-1"])
    assert (shown["session"], shown["parent_session"], shown["spawned"], shown["num_turns"]) == ("s1", "", ["s1-1"], 3)
    first, second, third = shown["turns"]
    assert first["messages"] == [{"role": "user", "text": USER["content"]}] and first["parent"] == -1
    assert first["reply"]["tool_calls"] == [
        {"id": "call_a", "name": "calculator", "arguments": '{"expression": "2+3"}'},
        {"id": "call_b", "name": "calculator", "arguments": '{"expression": "4*5"}'}]
    # the second request's new messages are the two results, not the history it repeats
    assert second["parent"] == 0 and [(m["role"], m["text"], m["tool_call_id"]) for m in second["messages"]] == [
        ("tool", "5", "call_a"), ("tool", "20", "call_b")]
    assert second["reply"] == {"role": "assistant", "text": "5 and 20."}
    assert second["context_tokens"] == len(trajectory.turns[1].context) and second["generated_tokens"] == 10
    # the sample is the last turn produced: the branch; the two turns before it are not trained
    assert [t["trained"] for t in shown["turns"]] == [False, False, True]
    assert third["branch"] == "the history repeats no turn the gateway produced" and third["parent"] == -1


def test_the_transcript_is_bounded_in_turns_messages_and_characters(monkeypatch):
    monkeypatch.setattr(transcript_module, "MAX_TURNS", 2)
    monkeypatch.setattr(transcript_module, "MAX_TEXT_CHARS", 4)
    monkeypatch.setattr(transcript_module, "MAX_TOTAL_CHARS", 10)
    shown = transcript(parallel_session(), "s1")
    assert len(shown["turns"]) == 2 and shown["num_turns"] == 3
    first, second = shown["turns"]
    assert first["messages"][0]["text"] == "What … (20 chars)"
    # 10 characters for the session: 4 of the question, 4 of the first call's arguments, the 2 left of the second's
    assert [c["arguments"] for c in first["reply"]["tool_calls"]] == ['{"ex … (21 chars)', '{" … (21 chars)']
    assert second["reply"]["text"] == " … (9 chars)"  # the session's budget is spent


def test_the_board_serves_the_transcript_after_the_buffers_wire_form_apart_from_the_list():
    shown = transcript(parallel_session(), "s1", "s0")
    sample = Sample(prompt="q", tokens=[5, 6], response="a", response_length=1, loss_mask=[1], metadata={
        "agent_turns": 3, "agent_branches": [{"turn": 2, "reason": "r"}], "agent_transcript": shown})
    wired = sample_from_proto(sample_to_proto(sample))  # ints come back as floats
    assert wired.metadata["agent_turns"] == 3.0
    plain = Sample(prompt="q", tokens=[5, 6], response="a", response_length=1, loss_mask=[1])
    board = SampleBoard()
    board.record("job", 4, [plain, wired])
    views = board.latest("job")["samples"]
    assert [v["has_session"] for v in views] == [False, True] and "agent_transcript" not in views[1]
    assert (views[1]["agent_turns"], views[1]["agent_branches"]) == (3, [{"turn": 2, "reason": "r"}])
    served = board.session("job", 4, 1)
    assert (served["session"], served["parent_session"], served["num_turns"]) == ("s1", "s0", 3)
    second = served["turns"][1]
    assert (second["index"], second["parent"], second["trained"], second["generated_tokens"]) == (1, 0, False, 10)
    assert (served["turns"][0]["parent"], served["turns"][2]["parent"]) == (-1, -1)  # each starts the session
    assert [(m["role"], m["text"], m["tool_call_id"]) for m in second["messages"]] == [
        ("tool", "5", "call_a"), ("tool", "20", "call_b")]
    assert [c["arguments"] for c in served["turns"][0]["reply"]["tool_calls"]] == [
        '{"expression": "2+3"}', '{"expression": "4*5"}']
    assert board.session("job", 3, 1) is None and board.session("job", 4, 0) is None
    assert board.session("job", 4, 2) is None and board.session("other", 4, 1) is None


def test_the_board_rebounds_a_transcript_a_plugin_wrote(monkeypatch):
    monkeypatch.setattr(sample_board, "MAX_TRANSCRIPT_TURNS", 2)
    turn = {"index": 0, "messages": [{"role": "user", "text": "x" * 10_000}] * 40, "reply": "not a message",
            "trained": "yes"}
    sample = Sample(prompt="q", tokens=[5, 6], response="a", response_length=1, loss_mask=[1], metadata={
        "agent_turns": 1, "agent_transcript": {"turns": [turn] * 5 + ["junk"], "spawned": "s2"}})
    board = SampleBoard()
    board.record("job", 0, [sample])
    served = board.session("job", 0, 0)
    assert len(served["turns"]) == 2 and served["spawned"] == [] and served["num_turns"] == 2
    first = served["turns"][0]
    assert len(first["messages"]) == sample_board.MAX_TRANSCRIPT_ITEMS and first["reply"] is None
    assert len(first["messages"][0]["text"]) < sample_board.MAX_TEXT_CHARS + 30 and first["trained"] is False
