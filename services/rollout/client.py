"""The rollout service's records (RolloutConfig, RolloutStatus, EngineInfo), their proto conversion, and its client.

Imports only the shared package, so the trainer can use it without pulling in the manager or the pool.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidArgument
from services.common.gen.physarum.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.grpc_client import GrpcClient
from services.common.samples import dict_to_struct, struct_to_dict


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """What the manager needs to know of a job; field names are slime's flags (proto RolloutConfig)."""

    job_id: str
    rollout_batch_size: int
    n_samples_per_prompt: int = 1
    tokenizer_path: str = ""  # default: the engines' model directory
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_max_response_len: int = 1024
    rollout_stop: list[str] = field(default_factory=list)
    rollout_stop_token_ids: list[int] = field(default_factory=list)
    rm_type: str = "math"
    custom_rm_path: str = ""
    reward_key: str = ""
    reward_timeout_s: float = 10.0
    loss_type: str = "policy_loss"  # "sft_loss": samples are prompt + label, no generation
    lease_timeout_s: float = 300.0
    args: dict[str, Any] = field(default_factory=dict)  # the whole job spec, for plugins

    def __post_init__(self) -> None:
        if not self.job_id:
            raise InvalidArgument("rollout config: job_id must not be empty")
        for name in ("rollout_batch_size", "n_samples_per_prompt", "rollout_max_response_len"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"rollout config: {name} must be > 0, got {getattr(self, name)}")
        for name in ("reward_timeout_s", "lease_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"rollout config: {name} must be > 0, got {getattr(self, name)}")
        if self.rollout_temperature < 0:
            raise InvalidArgument(f"rollout config: rollout_temperature must be >= 0, got {self.rollout_temperature}")
        if not 0 < self.rollout_top_p <= 1:
            raise InvalidArgument(f"rollout config: rollout_top_p must be in (0, 1], got {self.rollout_top_p}")


class RolloutState(enum.Enum):
    UNKNOWN = rollout_pb2.ROLLOUT_STATE_UNKNOWN  # this manager never started it (e.g. it restarted)
    RUNNING = rollout_pb2.ROLLOUT_STATE_RUNNING
    DONE = rollout_pb2.ROLLOUT_STATE_DONE
    FAILED = rollout_pb2.ROLLOUT_STATE_FAILED


@dataclass
class RolloutStatus:
    state: RolloutState
    num_groups_done: int = 0
    num_groups_target: int = 0
    error: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # rollout/* statistics


@dataclass
class EngineInfo:
    url: str  # SGLang-compatible HTTP endpoint
    weight_version: str = ""
    healthy: bool = False


def config_to_proto(config: RolloutConfig) -> rollout_pb2.RolloutConfig:
    values = dataclasses.asdict(config)
    return rollout_pb2.RolloutConfig(**{**values, "args": dict_to_struct(values["args"])})


def config_from_proto(msg: rollout_pb2.RolloutConfig) -> RolloutConfig:
    """Raises InvalidArgument naming the bad field."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(RolloutConfig)}
    values.update(rollout_stop=list(msg.rollout_stop), rollout_stop_token_ids=list(msg.rollout_stop_token_ids),
                  args=struct_to_dict(msg.args))
    return RolloutConfig(**values)


def status_to_proto(status: RolloutStatus) -> rollout_pb2.RolloutStatus:
    return rollout_pb2.RolloutStatus(state=status.state.value, num_groups_done=status.num_groups_done,
                                     num_groups_target=status.num_groups_target, error=status.error,
                                     metrics=status.metrics)


def status_from_proto(msg: rollout_pb2.RolloutStatus) -> RolloutStatus:
    state = RolloutState(msg.state) if msg.state else RolloutState.UNKNOWN
    return RolloutStatus(state=state, num_groups_done=msg.num_groups_done, num_groups_target=msg.num_groups_target,
                         error=msg.error, metrics=dict(msg.metrics))


def engine_to_proto(info: EngineInfo) -> rollout_pb2.EngineInfo:
    return rollout_pb2.EngineInfo(url=info.url, weight_version=info.weight_version, healthy=info.healthy)


class RolloutClient(GrpcClient):
    """Client of the rollout manager; every call has a deadline and all of them are idempotent."""

    service = "rollout"

    def __init__(self, addr: str, timeout_s: float = 10.0, max_retries: int = 3) -> None:
        super().__init__(addr, timeout_s, max_retries)
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)

    def start_rollout(self, config: RolloutConfig, rollout_id: int, weight_version: str) -> bool:
        """Start generating rollout `rollout_id`; returns already_running (the call is idempotent)."""
        request = rollout_pb2.StartRolloutRequest(config=config_to_proto(config), rollout_id=rollout_id,
                                                  weight_version=weight_version)
        return self.call(self.stub.StartRollout, request, idempotent=True).already_running

    def rollout_status(self, job_id: str, rollout_id: int) -> RolloutStatus:
        request = rollout_pb2.GetRolloutStatusRequest(job_id=job_id, rollout_id=rollout_id)
        return status_from_proto(self.call(self.stub.GetRolloutStatus, request, idempotent=True))

    def list_engines(self) -> tuple[list[EngineInfo], str]:
        """The pool's engines and the router URL."""
        reply = self.call(self.stub.ListEngines, rollout_pb2.ListEnginesRequest(), idempotent=True)
        engines = [EngineInfo(url=e.url, weight_version=e.weight_version, healthy=e.healthy) for e in reply.engines]
        return engines, reply.router_url
