"""Trainer service settings: its own ports, its peers, and where rank 0 hosts the weight-sync group."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import field


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    host: str = field("127.0.0.1", "address the gRPC and REST servers bind")
    port: int = field(50054, "gRPC port of the Jobs service (0 picks a free port)")
    rest_port: int = field(8080, "REST port of the job API (0 picks a free port)")
    buffer_addr: str = field("127.0.0.1:50051", "buffer service host:port")
    rollout_addr: str = field("127.0.0.1:50053", "rollout manager host:port")
    master_address: str = field("127.0.0.1", "address engines use to reach this trainer for weight sync")
    num_threads: int = field(2, "torch intra-op threads")
    client_timeout_s: float = field(30.0, "deadline of each call to the buffer and the rollout manager")
    grace_s: float = field(5.0, "seconds in-flight calls get on SIGTERM")

    def __post_init__(self) -> None:
        if self.num_threads <= 0:
            raise ValueError(f"num_threads must be > 0, got {self.num_threads}")
        if self.client_timeout_s <= 0:
            raise ValueError(f"client_timeout_s must be > 0, got {self.client_timeout_s}")
