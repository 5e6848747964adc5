"""slime.agent.adapters: OpenAIAdapter and AnthropicAdapter with slime's session calls (open_session,
finish_session, shutdown_session, drop_session) on the rollout service's agent gateway.

Differences from slime, by design: the gateway is already served by the rollout service, so an adapter has no `app`
to serve; `adapter.url` is where an agent reaches it (OpenAI: ending in /v1; Anthropic: the root). The tokenizer,
router and tool parser are the job's (the constructor's arguments are accepted and unused). As in slime, an agent
names its session by sending the session id as its API key, so session ids must be unguessable. A session is opened
from inside a generate function of a rollout.
"""

from __future__ import annotations

from typing import Any

from services.rollout.generation.agents import session_sample
from services.rollout.generation.generate import current_context


class BaseAdapter:
    api_suffix = ""

    def __init__(self, *, tokenizer: Any = None, sglang_url: Any = None, tool_parser: Any = None,
                 reasoning_parser: Any = None, max_turns_per_sid: int | None = None,
                 fork_threshold_tokens: int | None = None, debug_callback: Any = None) -> None:
        self.tokenizer = tokenizer
        self.app = None
        self.sessions: dict[str, Any] = {}
        self._url = ""

    @property
    def url(self) -> str:
        """The gateway's URL for this API (known once a session was opened in a rollout)."""
        return self._url

    def open_session(self, sid: str, *, sampling_defaults: dict | None = None, max_context_tokens: int = 0) -> None:
        """Open gateway session `sid` for the current rollout; the agent's API key is `sid`."""
        if sid in self.sessions:
            raise ValueError(f"session_id {sid!r} already exists; sids must be unique per agent run")
        ctx = current_context()
        if ctx.open_session is None:
            raise RuntimeError("slime.agent adapters: this rollout manager serves no agent gateway")
        sampling = dict(sampling_defaults or {})
        if max_context_tokens:
            sampling["max_new_tokens"] = min(sampling.get("max_new_tokens", max_context_tokens), max_context_tokens)
        self.sessions[sid] = session = ctx.open_session(sid, sampling, key=sid)
        self._url = session.gateway_url + self.api_suffix

    async def shutdown_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        """End the session: later requests with its key are refused."""
        session = self.sessions.get(sid)
        if session is not None:
            session.registry.close(session)

    async def finish_session(self, sid: str, *, base_sample: Any, reward: float = 0.0,
                             extra_metadata: dict | None = None, wait_timeout: float = 5.0) -> list:
        """The session's trajectory as [base_sample] (filled in place) with `reward`; [] for an unknown or
        already finished sid, or a session without turns."""
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        session = self.sessions.pop(sid, None)
        if session is None or session.trajectory.tip is None:
            return []
        sample = session_sample(base_sample, session, reward, False, f"slime.agent session {sid}")
        sample.metadata = {**sample.metadata, **(extra_metadata or {})}
        return [sample]

    async def drop_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        self.sessions.pop(sid, None)


class OpenAIAdapter(BaseAdapter):
    api_suffix = "/v1"


class AnthropicAdapter(BaseAdapter):
    api_suffix = ""


__all__ = ["AnthropicAdapter", "BaseAdapter", "OpenAIAdapter"]
