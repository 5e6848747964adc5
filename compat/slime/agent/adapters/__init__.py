"""slime.agent.adapters: the OpenAI and Anthropic adapters, whose sessions are the rollout service's agent-gateway
sessions (an adapter serves nothing itself: `adapter.url` is the gateway's)."""

from slime.agent.adapters.anthropic import AnthropicAdapter
from slime.agent.adapters.common import BaseAdapter
from slime.agent.adapters.openai import OpenAIAdapter

__all__ = ["AnthropicAdapter", "BaseAdapter", "OpenAIAdapter"]
