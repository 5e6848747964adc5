"""The agent gateway for tests: served from an event loop in a thread (so the real, synchronous `openai` and
`anthropic` clients can call it) in front of a real router; and the tiny tool-calling model it talks to."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from typing import Any

from examples.agent.model import build_agent_model
from services.common.rest import RestServer
from services.rollout.engine_calls.generate import GenerateContext, sampling_params
from services.rollout.engine_calls.router_http import AiohttpPoster
from services.rollout.gateway.app import create_app
from services.rollout.gateway.conversation import Limits
from services.rollout.gateway.sessions import Session, SessionRegistry
from services.rollout.generation.prompts import PromptEncoder

SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}}
OPENAI_TOOL = {"type": "function", "function": {"name": "calculator", "description": "Arithmetic.",
                                                 "parameters": SCHEMA}}
ANTHROPIC_TOOL = {"name": "calculator", "description": "Arithmetic.", "input_schema": SCHEMA}
QUESTION = "What is 2+3?"
# What the tiny model is taught to say: a calculator call, then the answer after the tool's result.
CALCULATOR_CONVERSATION = {"tools": [OPENAI_TOOL], "messages": [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."}]}
PARALLEL = "What is 2+3 and 4*5?"
# Two calls in one turn, then an answer after both results.
PARALLEL_CONVERSATION = {"tools": [OPENAI_TOOL], "messages": [
    {"role": "user", "content": PARALLEL},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}},
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "4*5"}}}]},
    {"role": "tool", "content": "5"}, {"role": "tool", "content": "20"},
    {"role": "assistant", "content": "5 and 20."}]}


def build_tool_model(out_dir: Path) -> Path:
    return build_agent_model(out_dir, conversations=[CALCULATOR_CONVERSATION])


class GatewayThread:
    def __init__(self, model_dir: Path, router_url: str, limits: Limits | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)
        self.thread.start()
        self.registry = SessionRegistry(limits)
        self.encoder = PromptEncoder(model_dir)
        self.http = AiohttpPoster(16, 120.0)
        self.ctx = GenerateContext(http=self.http, router_url=router_url, name="gateway test", rid_prefix="gw",
                                   max_attempts=2)
        self.server = RestServer(create_app(self.registry), "127.0.0.1", 0)
        self.call(self.server.start())
        self.url = f"http://127.0.0.1:{self.server.port}"

    def call(self, coro: Any, timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def open(self, max_new_tokens: int = 200, temperature: float = 0.0, images: bool = True) -> Session:
        """A session as the rollout manager opens one; `images`: its job trains on images (multimodal_keys)."""
        params = sampling_params(temperature=temperature, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens,
                                 stop=[], stop_token_ids=[])

        async def opened() -> Session:
            return self.registry.open(self.ctx, self.encoder, params, session_id=uuid.uuid4().hex[:12],
                                      images=images)

        return self.call(opened())

    def close_session(self, session: Session) -> None:
        self.loop.call_soon_threadsafe(self.registry.close, session)

    def close(self) -> None:
        try:
            self.call(self.server.stop())
            self.call(self.http.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
