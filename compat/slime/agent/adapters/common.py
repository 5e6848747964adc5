"""slime.agent.adapters.common: BaseAdapter with slime's session calls (open_session, finish_session,
shutdown_session, drop_session) on the rollout service's agent gateway, slime's Session and Reply records, the
helpers both wire formats share (flatten_content, tool_call_dict, manager_finish_reason) and slime's session-id
resolution (sid_from_bearer, sid_from_body).

Differences from slime, by design: the gateway is already served by the rollout service, so an adapter has no `app`
to serve; `adapter.url` is where an agent reaches it (OpenAI: ending in /v1; Anthropic: the root). The tokenizer,
router and tool parser are the job's (the constructor's arguments are accepted and unused). As in slime, an agent
names its session by sending the session id as its API key, so session ids must be unguessable. A session is opened
from inside a generate function of a rollout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.rollout.engine_calls.generate import current_context
from services.rollout.generation.agents import session_sample
from slime.agent.trajectory import TurnRecord


@dataclasses.dataclass
class Session:
    """slime's per-session settings (the gateway session itself is Physarum's)."""

    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    max_context_tokens: int = 0


@dataclasses.dataclass
class Reply:
    """slime's adapter reply record: the message kept for the trajectory, its finish reason, the wire payload."""

    manager_message: dict
    finish_reason: str
    wire: Any


def flatten_content(content: Any) -> str:
    """A message's content (a string, or OpenAI / Anthropic content blocks) as one chat-template string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return str(content)
    parts = []
    for block in content:
        if not isinstance(block, dict):
            parts.append(str(block))
        elif block.get("type") in ("text", "input_text", "output_text"):
            parts.append(block.get("text", ""))
        elif block.get("type") in ("image", "image_url", "input_image"):
            parts.append("[image omitted]")
        elif "content" in block:  # tool_result and other nesting blocks
            parts.append(flatten_content(block.get("content")))
        elif "text" in block:
            parts.append(str(block.get("text") or ""))
    return "\n".join(part for part in parts if part)


def tool_call_dict(name: str, arguments: dict | None) -> dict:
    """A tool call as the trajectory keeps it: OpenAI's shape, arguments a dict, no wire id."""
    return {"type": "function", "function": {"name": name, "arguments": arguments or {}}}


def manager_finish_reason(tool_uses: list[dict], raw_finish: str) -> str:
    return "tool_calls" if tool_uses else (raw_finish or "stop")


def sid_from_bearer(request: Any) -> str | None:
    """The session id an agent sends as its API key (`Authorization: Bearer <sid>`), as the gateway reads it."""
    auth = request.headers.get("Authorization", "")
    return (auth[7:].strip() or None) if auth.lower().startswith("bearer ") else None


def sid_from_body(body: dict | None) -> str | None:
    """The session id an OpenAI-shape body names (metadata.session_id, else user). Physarum's gateway names a
    session by API key only (an unguessable secret); this resolves what slime's adapter would read."""
    if not body:
        return None
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and metadata.get("session_id"):
        return str(metadata["session_id"])
    return str(body["user"]) if body.get("user") else None


class BaseAdapter:
    api_suffix = ""

    def __init__(self, *, tokenizer: Any = None, sglang_url: Any = None, tool_parser: Any = None,
                 reasoning_parser: Any = None, max_turns_per_sid: int | None = None,
                 fork_threshold_tokens: int | None = None, debug_callback: Any = None) -> None:
        self.tokenizer = tokenizer
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.max_turns_per_sid = max_turns_per_sid
        self.app = None
        self.sessions: dict[str, Any] = {}  # sid -> the gateway session
        self.store: dict[str, Session] = {}  # sid -> slime's Session record
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
        self.store[sid] = Session(sampling_defaults=dict(sampling_defaults or {}),
                                  max_context_tokens=int(max_context_tokens or 0))
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
        self.store.pop(sid, None)
        if session is None or session.trajectory.tip is None:
            return []
        sample = session_sample(base_sample, session, reward, False, f"slime.agent session {sid}")
        sample.metadata = {**sample.metadata, **(extra_metadata or {})}
        return [sample]

    async def drop_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        self.sessions.pop(sid, None)
        self.store.pop(sid, None)


__all__ = ["BaseAdapter", "Reply", "Session", "TurnRecord", "flatten_content", "manager_finish_reason",
           "sid_from_bearer", "sid_from_body", "tool_call_dict"]
