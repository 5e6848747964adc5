"""A session as its agent saw it, for the dashboard: each turn the gateway produced, with the messages its request
added to the turn it continues (the user's text, the tool results), the assistant message as the APIs returned it
(its text and tool calls), its token counts and whether the sample trains on it; the sessions it spawned or was
spawned from. Tool-call ids are in OpenAI's form (Anthropic's tool_use ids are the same with toolu_ for call_).
Bounded in turns, messages and characters, as it travels in the sample's metadata.
"""

from __future__ import annotations

import json
from typing import Any

from services.rollout.gateway.conversation import count_image_parts, text_of
from services.rollout.gateway.trajectory import Trajectory, Turn

MAX_TURNS = 32  # per session shown (the first ones); the rest are counted
MAX_MESSAGES = 12  # new messages shown per turn (the last ones: the tool results next to the reply)
MAX_TOOL_CALLS = 8  # per assistant message
MAX_TEXT_CHARS = 1500  # per message text or tool-call arguments
MAX_TOTAL_CHARS = 24000  # per session: past it, texts are cut to a note of their length


class _Budget:
    """Characters left for the session's texts."""

    def __init__(self, total: int) -> None:
        self.left = total

    def clip(self, text: str) -> str:
        keep = max(0, min(len(text), MAX_TEXT_CHARS, self.left))
        self.left -= keep
        return text if keep == len(text) else text[:keep] + f" … ({len(text)} chars)"


def _message(message: dict[str, Any], budget: _Budget) -> dict[str, Any]:
    """A message in the form the dashboard reads: role, text (an image part as [image]), tool calls, tool call id."""
    text = text_of(message)
    if images := count_image_parts(message):
        text = f"{text} [{images} image{'s' if images > 1 else ''}]".strip()
    shown: dict[str, Any] = {"role": message["role"], "text": budget.clip(text)}
    calls = message.get("tool_calls") or []
    if calls:
        shown["tool_calls"] = [{"id": str(call.get("id", "")), "name": call["function"]["name"],
                                "arguments": budget.clip(_arguments(call["function"]["arguments"]))}
                               for call in calls[:MAX_TOOL_CALLS]]
        shown["num_tool_calls"] = len(calls)
    if message.get("tool_call_id"):
        shown["tool_call_id"] = str(message["tool_call_id"])
    return shown


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _turn(turn: Turn, trained: bool, branch: str, budget: _Budget) -> dict[str, Any]:
    new = turn.messages[len(turn.parent.keys) if turn.parent is not None else 0:-1]
    return {"index": turn.index, "parent": turn.parent.index if turn.parent is not None else -1,
            "messages": [_message(m, budget) for m in new[-MAX_MESSAGES:]],
            "num_messages": len(new), "reply": _message(turn.messages[-1], budget),
            "context_tokens": len(turn.context), "generated_tokens": len(turn.generated), "trained": trained,
            "finish": turn.finish, "branch": branch}


def transcript(trajectory: Trajectory, session_id: str, parent_id: str = "",
               spawned: list[str] | None = None) -> dict[str, Any]:
    """The session's turns in the order produced; `trained` marks the path the sample is (its generated tokens
    have loss_mask 1, the tokens before each of them 0); the others are branches or other choices, not trained."""
    trained = {turn.index for turn in trajectory.tip.path()} if trajectory.tip is not None else set()
    branches = {b.turn: b.reason for b in trajectory.branches}
    budget = _Budget(MAX_TOTAL_CHARS)
    turns = [_turn(turn, turn.index in trained, branches.get(turn.index, ""), budget)
             for turn in trajectory.turns[:MAX_TURNS]]
    return {"session": session_id, "parent_session": parent_id, "spawned": list(spawned or [])[:MAX_TURNS],
            "turns": turns, "num_turns": len(trajectory.turns)}
