"""`make demo-agent`'s agent: an ordinary `openai`-client agent whose one tool, `solve`, works out the arithmetic in
the user's question (it takes no arguments: the environment reads the question). The model has only to learn to
call it, rather than answer in its head, and to copy its result into the answer.

Job keys (examples/agent/demo.yaml):
    agent_function_path: examples.agent.solver.agent
    custom_rm_path: examples.agent.reward.reward
"""

from __future__ import annotations

import re
from typing import Any

from openai import AsyncOpenAI, BadRequestError

from examples.multiturn.calculator import calculate

MAX_CALLS = 2
TOOL = {"type": "function", "function": {"name": "solve", "description": "Works out the question's arithmetic.",
                                         "parameters": {"type": "object", "properties": {}}}}
_EXPRESSION = re.compile(r"[\d*+\-/ ()]+\d")


def solve(messages: list[dict[str, Any]]) -> str:
    """The arithmetic of the last user message, worked out ("" when it holds none)."""
    question = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")
    found = _EXPRESSION.findall(question)
    return calculate(max(found, key=len).strip()) if found else ""


async def agent(base_url: str, api_key: str, prompt: dict[str, Any]) -> None:
    """Ask; run `solve` for every call the model makes; give its result back, until the model answers."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=300.0, max_retries=0)
    messages = list(prompt["messages"]) or [{"role": "user", "content": prompt["prompt"]}]
    try:
        for _ in range(MAX_CALLS + 1):
            try:
                reply = await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])
            except BadRequestError as err:
                if "response budget" in str(err):
                    return None
                raise
            choice = reply.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if not choice.message.tool_calls or choice.finish_reason == "length":
                return None
            for call in choice.message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": solve(messages)})
    finally:
        await client.close()
    return None
