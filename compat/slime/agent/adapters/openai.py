"""slime.agent.adapters.openai: OpenAIAdapter, an agent's OpenAI Chat Completions endpoint (`adapter.url`, ending in
/v1) on the rollout service's agent gateway; the session id is the agent's API key (Bearer), as in slime."""

from slime.agent.adapters.common import BaseAdapter


class OpenAIAdapter(BaseAdapter):
    api_suffix = "/v1"


__all__ = ["OpenAIAdapter"]
