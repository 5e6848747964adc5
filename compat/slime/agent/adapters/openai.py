"""slime.agent.adapters.openai"""

from slime.agent.adapters import OpenAIAdapter

__all__ = ["OpenAIAdapter"]
