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
