"""Settings of the Reward service: flags --x-y, env PHYSARUM_REWARD_<FIELD>, then these defaults."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import field


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    host: str = field("127.0.0.1", "address the gRPC and REST servers bind")
    port: int = field(50052, "gRPC port (0 picks a free one)")
    rest_port: int = field(8082, "REST port: POST /v1/score, GET /healthz, OpenAPI at /docs (0 picks a free one)")
    max_concurrency: int = field(64, "samples scored at once, over all requests")
    default_timeout_s: float = field(10.0, "per-sample timeout when a request sets none")
    num_workers: int = field(4, "worker processes that run scorers (a sample past its timeout kills its worker)")
    worker_memory_bytes: int = field(2 << 30, "address-space limit of each worker process (0: none)")
    grace_s: float = field(5.0, "seconds in-flight requests get to finish on SIGTERM")

    def __post_init__(self) -> None:
        for name in ("port", "rest_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        if self.max_concurrency <= 0:
            raise ValueError(f"max_concurrency must be > 0, got {self.max_concurrency}")
        if self.num_workers <= 0:
            raise ValueError(f"num_workers must be > 0, got {self.num_workers}")
        if self.worker_memory_bytes < 0:
            raise ValueError(f"worker_memory_bytes must be >= 0, got {self.worker_memory_bytes}")
        if self.default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be > 0, got {self.default_timeout_s}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
