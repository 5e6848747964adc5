"""slime.agent.adapters.anthropic: AnthropicAdapter, an agent's Anthropic Messages endpoint (`adapter.url`, the
gateway's root) on the rollout service's agent gateway; the session id is the agent's API key, as in slime."""

from slime.agent.adapters.common import BaseAdapter


class AnthropicAdapter(BaseAdapter):
    api_suffix = ""


__all__ = ["AnthropicAdapter"]
