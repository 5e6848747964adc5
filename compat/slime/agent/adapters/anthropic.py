"""slime.agent.adapters.anthropic"""

from slime.agent.adapters import AnthropicAdapter

__all__ = ["AnthropicAdapter"]
