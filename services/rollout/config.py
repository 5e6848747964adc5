"""Settings of the rollout manager: its peers (buffer, reward, router), its engine pool and its timeouts."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import field


@dataclass(frozen=True, kw_only=True)
class RolloutManagerConfig:
    host: str = field("127.0.0.1", "address the gRPC server binds")
    port: int = field(50053, "gRPC port (0 picks a free one)")
    buffer_addr: str = field("127.0.0.1:50051", "buffer service host:port")
    reward_addr: str = field("127.0.0.1:50052", "reward service host:port")
    router_url: str = field("http://127.0.0.1:30000", "sglang-router base URL; /generate goes through it")
    model_path: str = field("", "HF model directory of the engines (and the default tokenizer)")
    num_engines: int = field(0, "local CPU engine processes this manager starts")
    engine_urls: list[str] = field([], "already-running engines to register with the router (comma-separated)")
    engine_num_threads: int = field(1, "torch threads per local engine")
    engine_start_timeout_s: float = field(120.0, "how long a local engine may take to answer /health")
    request_timeout_s: float = field(120.0, "timeout of one /generate call through the router")
    work_dir: str = field("", "directory for engine logs (default: a new temporary directory)")
    grace_s: float = field(5.0, "seconds in-flight RPCs get on shutdown")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"router_url must start with http:// or https://, got {self.router_url!r}")
        if self.num_engines < 0:
            raise ValueError(f"num_engines must be >= 0, got {self.num_engines}")
        if self.num_engines > 0 and not self.model_path:
            raise ValueError(f"model_path is required to start {self.num_engines} local engines")
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine_urls: {url!r} must start with http:// or https://")
        if self.engine_num_threads < 1:
            raise ValueError(f"engine_num_threads must be >= 1, got {self.engine_num_threads}")
        for name in ("engine_start_timeout_s", "request_timeout_s", "grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
