"""Agent functions for the agent-rollout tests (agent_function_path)."""

from __future__ import annotations

import asyncio

import httpx
from openai import AsyncOpenAI


async def stalling_agent(base_url: str, api_key: str, prompt: dict) -> None:
    """One turn, a reward of its own choosing posted on its session, then it hangs: the timeout must end it."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=120.0, max_retries=0) as client:
        await client.chat.completions.create(model="policy", max_tokens=3,
                                             messages=[{"role": "user", "content": prompt["prompt"]}])
    async with httpx.AsyncClient(timeout=30.0) as http:
        reply = await http.post(f"{base_url}/session/reward", json={"reward": 0.25},
                                headers={"Authorization": f"Bearer {api_key}"})
        reply.raise_for_status()
    await asyncio.sleep(3600)


_ADAPTER = None


async def slime_style_generate(args, sample, sampling_params):
    """The pattern of slime's coding-agent generate function on slime.agent's adapters: open a session, run an
    Anthropic-API agent against it (here the calculator conversation), drain the session into samples."""
    import secrets

    from anthropic import AsyncAnthropic
    from slime.agent.adapters import AnthropicAdapter

    from tests.integration.gateway_fixtures import ANTHROPIC_TOOL

    global _ADAPTER
    _ADAPTER = _ADAPTER or AnthropicAdapter(tokenizer=None, sglang_url="http://unused")
    sid = f"slime-{secrets.token_hex(16)}"
    _ADAPTER.open_session(sid, sampling_defaults=sampling_params)
    try:
        async with AsyncAnthropic(base_url=_ADAPTER.url, api_key=sid, timeout=120.0, max_retries=0) as client:
            messages = [{"role": "user", "content": sample.prompt_messages[-1]["content"]}]
            first = await client.messages.create(model="m", max_tokens=120, messages=messages, tools=[ANTHROPIC_TOOL])
            use = next(block for block in first.content if block.type == "tool_use")
            messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": "5"}]}]
            await client.messages.create(model="m", max_tokens=120, messages=messages, tools=[ANTHROPIC_TOOL])
        return await _ADAPTER.finish_session(sid, base_sample=sample, reward=1.0,
                                             extra_metadata={"harness": "anthropic"})
    finally:
        await _ADAPTER.drop_session(sid)


async def spawning_agent(base_url: str, api_key: str, prompt: dict) -> float:
    """The calculator agent, then a sub-agent on a session it spawns: one turn, scored 0 on its own session; the
    first session's reward is the return value, 1."""
    from examples.agent.calculator import agent

    await agent(base_url, api_key, prompt)
    async with httpx.AsyncClient(timeout=30.0) as http:
        reply = await http.post(f"{base_url}/session/spawn", headers={"Authorization": f"Bearer {api_key}"})
        reply.raise_for_status()
        sub_key = reply.json()["api_key"]
        async with AsyncOpenAI(base_url=base_url, api_key=sub_key, timeout=120.0, max_retries=0) as client:
            await client.chat.completions.create(model="policy", max_tokens=3, messages=list(prompt["messages"]))
        reply = await http.post(f"{base_url}/session/reward", json={"reward": 0.0},
                                headers={"Authorization": f"Bearer {sub_key}"})
        reply.raise_for_status()
    return 1.0
