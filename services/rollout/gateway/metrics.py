"""The gateway's Prometheus metrics (physarum_gateway_*), in a registry of their own served at /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.sessions_open = Gauge("physarum_gateway_sessions_open", "agent sessions open", registry=self.registry)
        self.turns = Counter("physarum_gateway_turns_total", "completions generated", registry=self.registry)
        self.prompt_tokens = Counter("physarum_gateway_prompt_tokens_total", "tokens sent to the engines",
                                     registry=self.registry)
        self.completion_tokens = Counter("physarum_gateway_completion_tokens_total", "tokens the engines generated",
                                         registry=self.registry)
        self.cached_tokens = Counter("physarum_gateway_cached_tokens_total", "prompt tokens the engines found in "
                                     "their prefix cache", registry=self.registry)
        self.branches = Counter("physarum_gateway_branches_total", "turns whose history did not continue the last "
                                "turn produced", registry=self.registry)
        self.turn_seconds = Histogram("physarum_gateway_turn_seconds", "seconds per completion, render to reply",
                                      registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
