"""The calculator agent: examples/multiturn's task (arithmetic with a calculator) written as an ordinary agent with the
`openai` client and a `calculator` tool. It knows nothing of training: the rollout manager runs it once per sample
against a session of the agent gateway, and the session's exact tokens become the sample.

Job keys (examples/agent/job.yaml):
    agent_function_path: examples.agent.calculator.agent
    custom_rm_path: examples.agent.reward.reward
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI, BadRequestError

from examples.multiturn.calculator import calculate

MAX_CALLS = 3  # calculator calls before the agent stops asking
TOOL = {"type": "function", "function": {"name": "calculator", "description": "Arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}


async def agent(base_url: str, api_key: str, prompt: dict[str, Any]) -> None:
    """Ask, run the calculator for every call the model makes, give its results back, until the model answers or the
    session's response budget is spent (the gateway refuses the next turn with HTTP 400: the episode is over)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=300.0, max_retries=0)
    messages = list(prompt["messages"]) or [{"role": "user", "content": prompt["prompt"]}]
    try:
        for _ in range(MAX_CALLS + 1):
            try:
                reply = await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])
            except BadRequestError as err:
                if "response budget" in str(err):  # the tool results filled the session's budget
                    return None
                raise
            choice = reply.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if not choice.message.tool_calls or choice.finish_reason == "length":
                return None
            for call in choice.message.tool_calls:
                try:
                    expression = str(json.loads(call.function.arguments).get("expression", ""))
                except ValueError:
                    expression = ""
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    finally:
        await client.close()
    return None

