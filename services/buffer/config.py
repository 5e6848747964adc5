"""The buffer's settings: where it listens and which Redis holds its data."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import field

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True, kw_only=True)
class BufferConfig:
    host: str = field("127.0.0.1", "address the gRPC server binds")
    port: int = field(50051, "gRPC port (0 picks a free one)")
    redis_url: str = field("redis://127.0.0.1:6379/0", "Redis that stores every dataset, lease and group")
    redis_wait_s: float = field(30.0, "how long to wait for Redis at start (health is NOT_SERVING meanwhile)")
    grace_s: float = field(5.0, "how long in-flight calls may finish after SIGTERM")
    metrics_port: int = field(0, "port of the Prometheus /metrics endpoint (0: none; the chart sets one)")
    metrics_interval_s: float = field(10.0, "how often the backlog gauges are read from Redis")
    data_roots: list[str] = field([], "directories LoadDataset may read under (empty: any path, for local runs)")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.redis_url.startswith(REDIS_SCHEMES):
            raise ValueError(f"redis_url must start with one of {', '.join(REDIS_SCHEMES)}, got {self.redis_url!r}")
        if self.redis_wait_s <= 0:
            raise ValueError(f"redis_wait_s must be > 0, got {self.redis_wait_s}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.metrics_interval_s <= 0:
            raise ValueError(f"metrics_interval_s must be > 0, got {self.metrics_interval_s}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
