"""The weight broadcast's settings (Physarum's own: slime's update_weight_buffer_size and timeouts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.common.config import POSITIVE, check_fields, field


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    update_weight_buffer_size: int = field(512 << 20, "bytes per broadcast bucket (slime's default)", POSITIVE)
    weight_sync_backend: Literal["auto", "gloo", "nccl", "shm"] = field(
        "auto", "how weights reach the engines: nccl, gloo (torch.distributed groups), shm (engines on the trainer's "
                "host load a snapshot from /dev/shm), auto (shm for engines on the trainer's host, nccl from CUDA "
                "ranks to GPU engines on other hosts, else gloo)")
    weight_sync_timeout_s: float = field(60.0, "seconds one weight sync may take", POSITIVE)

    def __post_init__(self) -> None:
        check_fields(self)
