"""Trainer service settings: its own ports, its peers, its place among the trainer's ranks, and where rank 0 hosts
the weight-sync group."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.common.config import field
from services.trainer.backends.capabilities import BACKENDS

DIST_BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")  # devices.DEVICES, kept here so the config imports no torch
WEIGHT_SYNC_BACKENDS = ("auto", "gloo", "nccl", "shm", "disk")  # the job spec's weight_sync_backend values
TRAIN_BACKENDS = tuple(BACKENDS)  # the job spec's train_backend values


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
    api_token: str = field("", "bearer token the job API requires (REST `Authorization: Bearer`, gRPC "
                               "`authorization` metadata); empty: no token (the local stack)")
    jobs_redis_url: str = field("", "Redis that keeps the job records (spec, state, events, checkpoints), so jobs "
                                    "outlive the trainer and resume when it comes back; empty: in memory, lost with it")
    job_max_restarts: int = field(3, "times in a row a job resumes after the trainer died, lost a rank or was "
                                     "evicted while it ran without progress since its start before (a new "
                                     "checkpoint; after an eviction, a trained rollout); one more: FAILED")
    preempt_timeout_s: float = field(300.0, "on SIGTERM, seconds the running job gets to reach its next safe point, "
                                            "checkpoint and stop (below the pod's terminationGracePeriodSeconds)")
    # The trainer's ranks (torchrun's variables): rank 0 is this service, ranks 1.. run services.trainer.ranks.worker.
    data_roots: list[str] = field([], "directories job specs may read models and datasets under (empty: any)")
    checkpoint_roots: list[str] = field([], "directories job specs may save and load checkpoints under (empty: any)")
    export_roots: list[str] = field([], "directories job specs may export models and dumps under (empty: any)")
    rank: int = field(int(os.environ.get("RANK", "0")), "this process's trainer rank (default: $RANK)")
    world_size: int = field(int(os.environ.get("WORLD_SIZE", "1")), "number of trainer ranks (default: $WORLD_SIZE)")
    master_addr: str = field(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                             "rank 0's address, where the ranks meet (default: $MASTER_ADDR)")
    master_port: int = field(int(os.environ.get("MASTER_PORT", "29500")),
                             "rank 0's port for the ranks' store (default: $MASTER_PORT)")
    dist_backend: str = field("auto", "collectives between trainer ranks: gloo (CPU), nccl (GPU) or auto (nccl "
                                      "when the ranks are on CUDA)")
    device: str = field("auto", "where each rank trains: cuda (cuda:LOCAL_RANK), cpu, or auto (cuda when present)")
    dist_timeout_s: float = field(1800.0, "deadline of a collective between trainer ranks; must exceed the longest "
                                          "rank-0-only phase (a job's rollout_timeout_s, a weight sync)")
    default_train_backend: str = field("fsdp", "train_backend of submitted jobs that name none: fsdp (torch FSDP2) "
                                               "or megatron (megatron-core, TP/PP)")
    default_weight_sync_backend: str = field("auto", "weight_sync_backend of submitted jobs that name none: auto "
                                                     "(nccl to GPU engines on other hosts from CUDA ranks), nccl, gloo")
    tensorboard_dir: str = field("", "write TensorBoard event files under DIR/<job_id> (default: <save>/tensorboard "
                                     "for jobs with `save`)")

    def __post_init__(self) -> None:
        if self.num_threads <= 0:
            raise ValueError(f"num_threads must be > 0, got {self.num_threads}")
        if self.client_timeout_s <= 0:
            raise ValueError(f"client_timeout_s must be > 0, got {self.client_timeout_s}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {self.rank} of world_size {self.world_size}")
        if self.dist_backend not in DIST_BACKENDS:
            raise ValueError(f"dist_backend must be one of {', '.join(DIST_BACKENDS)}, got {self.dist_backend!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.default_train_backend not in TRAIN_BACKENDS:
            raise ValueError(f"default_train_backend must be one of {', '.join(TRAIN_BACKENDS)}, got "
                             f"{self.default_train_backend!r}")
        if self.default_weight_sync_backend not in WEIGHT_SYNC_BACKENDS:
            raise ValueError(f"default_weight_sync_backend must be one of {', '.join(WEIGHT_SYNC_BACKENDS)}, got "
                             f"{self.default_weight_sync_backend!r}")
        if self.jobs_redis_url and not self.jobs_redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"jobs_redis_url must start with redis://, rediss:// or unix://, got "
                             f"{self.jobs_redis_url!r}")
        if self.preempt_timeout_s <= 0:
            raise ValueError(f"preempt_timeout_s must be > 0, got {self.preempt_timeout_s}")
        if self.job_max_restarts < 0:
            raise ValueError(f"job_max_restarts must be >= 0, got {self.job_max_restarts}")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")
