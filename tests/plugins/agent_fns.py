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


OBSERVATION = (20, 200, 20)  # the colour of the image image_agent's second turn sends


def _anthropic_blocks(content: str | list[dict]) -> str | list[dict]:
    """OpenAI content parts as Anthropic blocks: an image_url part's data: URL as a base64 image block."""
    if isinstance(content, str):
        return content
    blocks = []
    for part in content:
        if part["type"] == "image_url":
            header, _, data = part["image_url"]["url"].partition(",")
            blocks.append({"type": "image", "source": {"type": "base64", "data": data,
                                                       "media_type": header.removeprefix("data:").split(";")[0]}})
        else:
            blocks.append(part)
    return blocks


async def image_agent(base_url: str, api_key: str, prompt: dict) -> None:
    """Two turns on a job with images: the prompt's messages as given (its image in them), then an observation that
    carries an image of its own. The openai client, or the anthropic one when the prompt's metadata names it; the
    job's reward settings score the last reply."""
    from anthropic import AsyncAnthropic

    from testkit.images import data_url, png

    observation = [{"type": "text", "text": "and this one?"},
                   {"type": "image_url", "image_url": {"url": data_url(png(36, 28, OBSERVATION))}}]
    if prompt["metadata"].get("api") == "anthropic":
        async with AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, timeout=120.0,
                                  max_retries=0) as claude:
            messages = [{"role": m["role"], "content": _anthropic_blocks(m["content"])} for m in prompt["messages"]]
            first = await claude.messages.create(model="policy", max_tokens=4, messages=messages)
            messages += [{"role": "assistant", "content": first.content[0].text if first.content else ""},
                         {"role": "user", "content": _anthropic_blocks(observation)}]
            await claude.messages.create(model="policy", max_tokens=4, messages=messages)
        return None
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=120.0, max_retries=0) as client:
        messages = list(prompt["messages"])
        first = await client.chat.completions.create(model="policy", max_tokens=4, messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": observation}]
        await client.chat.completions.create(model="policy", max_tokens=4, messages=messages)
    return None
