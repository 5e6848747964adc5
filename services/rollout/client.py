"""The rollout service's records (RolloutStatus, EngineInfo, PoolStatus), the proto conversion of them and of a job's
RolloutConfig (services.common.settings.rollout), and its client.

Imports only the shared package, so the trainer can use it without pulling in the manager or the pool.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

from services.common.gen.physarum.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.grpc_client import GrpcClient
from services.common.samples import dict_to_struct, struct_to_dict
from services.common.settings.rollout import RolloutConfig
from services.common.sglang import unversioned_adapter_name


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
    metrics: dict[str, float] = dataclass_field(default_factory=dict)  # rollout/* statistics


@dataclass
class EngineInfo:
    url: str  # SGLang-compatible HTTP endpoint
    weight_version: str = ""
    healthy: bool = False


class EngineState(enum.Enum):
    STARTING = rollout_pb2.ENGINE_STATE_STARTING  # launched, not answering /health yet
    JOINING = rollout_pb2.ENGINE_STATE_JOINING  # answers /health; gets the current weights before any request
    SERVING = rollout_pb2.ENGINE_STATE_SERVING  # registered with the router
    DRAINING = rollout_pb2.ENGINE_STATE_DRAINING  # leaving: deregistered, its requests aborted (retried elsewhere)
    FAILED = rollout_pb2.ENGINE_STATE_FAILED  # dead or hung: deregistered, being replaced


@dataclass
class EngineStatus:
    """One engine of the pool as its controller sees it (proto EngineStatus)."""

    name: str
    url: str
    state: EngineState
    pid: int = 0  # local processes only
    weight_version: str = ""  # the version it is known to hold in full ("" if none yet)
    healthy: bool = False
    load: int = 0  # requests in flight, as the router counts them
    external: bool = False  # not launched by the pool: never replaced


@dataclass
class ScaleEvent:
    time_s: float  # unix time
    kind: str  # scale, launch, join, demote, drain, stop, fail, replace
    engine: str = ""
    detail: str = ""


@dataclass
class PoolStatus:
    desired_replicas: int
    engines: list[EngineStatus] = dataclass_field(default_factory=list)
    weight_version: str = ""  # the trainer's current version ("" before its first sync)
    join_mode: str = "disk"
    snapshot_dir: str = ""
    router_url: str = ""
    rest_url: str = ""
    events: list[ScaleEvent] = dataclass_field(default_factory=list)
    weight_sync_in_progress: bool = False
    # each LoRA adapter's last version the engines took, by name (the jobs sharing the pool each version their own)
    adapter_versions: dict[str, str] = dataclass_field(default_factory=dict)

    def count(self, *states: EngineState) -> int:
        return sum(e.state in states for e in self.engines)


@dataclass
class WeightSyncPlan:
    """What the pool answers BeginWeightSync: the engines to broadcast to, and where to write a snapshot."""

    engine_urls: list[str]
    snapshot_dir: str = ""


SNAPSHOT_PREFIX = "weight_v"  # slime's update_weight_disk_dir layout: <snapshot_dir>/weight_v<version>
ADAPTER_ROOT_PREFIX = "lora-"  # a LoRA job's snapshots: <snapshot_dir>/lora-<job>/weight_v<version>
ADAPTERS_DIR = "adapters"  # a LoRA job's snapshot: <snapshot>/adapters/<lora_name>/, PEFT's adapter directory each


def snapshot_path(snapshot_dir: str | Path, version: str | int) -> Path:
    """Where the trainer writes the snapshot of weight version `version` (engines joining by disk load it there)."""
    return Path(snapshot_dir) / f"{SNAPSHOT_PREFIX}{version}"


def adapter_snapshot_root(snapshot_dir: str | Path, lora_name: str) -> Path:
    """The directory under `snapshot_dir` that holds the snapshots of LoRA job `lora_name` (its served name at a
    version, versioned_adapter_name's, counts as the job's name): `snapshot_dir/lora-<job>/`, one per job, so that
    jobs sharing a pool neither replace nor prune each other's."""
    job = unversioned_adapter_name(lora_name)
    if not job or job in (".", "..") or "/" in job or "\\" in job:
        raise ValueError(f"LoRA adapter name {lora_name!r} cannot name a snapshot directory")
    return Path(snapshot_dir) / f"{ADAPTER_ROOT_PREFIX}{job}"


def config_to_proto(config: RolloutConfig) -> rollout_pb2.RolloutConfig:
    values = dataclasses.asdict(config)
    int_args = sorted(k for k, v in values["args"].items() if isinstance(v, int) and not isinstance(v, bool))
    return rollout_pb2.RolloutConfig(**{**values, "args": dict_to_struct(values["args"]), "int_args": int_args,
                                        "eval_dataset_settings": dict_to_struct(values["eval_dataset_settings"])})


def config_from_proto(msg: rollout_pb2.RolloutConfig) -> RolloutConfig:
    """Raises InvalidArgument naming the bad field. `args`' integers are integers again (plugins do
    range(args.n_samples_per_prompt))."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(RolloutConfig)}
    args = struct_to_dict(msg.args)
    args.update({key: int(args[key]) for key in msg.int_args if isinstance(args.get(key), float)})
    values.update(rollout_stop=list(msg.rollout_stop), rollout_stop_token_ids=list(msg.rollout_stop_token_ids),
                  args=args, eval_prompt_data=list(msg.eval_prompt_data), multimodal_keys=dict(msg.multimodal_keys),
                  eval_dataset_settings=struct_to_dict(msg.eval_dataset_settings))
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


def pool_status_to_proto(status: PoolStatus) -> rollout_pb2.PoolStatus:
    values = dataclasses.asdict(status)
    engines = [rollout_pb2.EngineStatus(**{**dataclasses.asdict(e), "state": e.state.value}) for e in status.engines]
    return rollout_pb2.PoolStatus(**{**values, "engines": engines,
                                     "events": [rollout_pb2.ScaleEvent(**e) for e in values["events"]]})


def pool_status_from_proto(msg: rollout_pb2.PoolStatus) -> PoolStatus:
    engines = [EngineStatus(name=e.name, url=e.url, state=EngineState(e.state), pid=e.pid,
                            weight_version=e.weight_version, healthy=e.healthy, load=e.load, external=e.external)
               for e in msg.engines]
    events = [ScaleEvent(time_s=e.time_s, kind=e.kind, engine=e.engine, detail=e.detail) for e in msg.events]
    return PoolStatus(desired_replicas=msg.desired_replicas, engines=engines, weight_version=msg.weight_version,
                      join_mode=msg.join_mode, snapshot_dir=msg.snapshot_dir, router_url=msg.router_url,
                      rest_url=msg.rest_url, events=events, weight_sync_in_progress=msg.weight_sync_in_progress,
                      adapter_versions=dict(msg.adapter_versions))


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

    def stop_rollout(self, job_id: str, rollout_id: int) -> RolloutStatus:
        """Cancel a running rollout (a fully_async stream); its leased prompts go back to the buffer."""
        request = rollout_pb2.StopRolloutRequest(job_id=job_id, rollout_id=rollout_id)
        return status_from_proto(self.call(self.stub.StopRollout, request, idempotent=True))

    def rollout_status(self, job_id: str, rollout_id: int) -> RolloutStatus:
        request = rollout_pb2.GetRolloutStatusRequest(job_id=job_id, rollout_id=rollout_id)
        return status_from_proto(self.call(self.stub.GetRolloutStatus, request, idempotent=True))

    def run_eval(self, config: RolloutConfig, rollout_id: int, weight_version: str,
                 timeout_s: float = 600.0) -> dict[str, float]:
        """Evaluate on config.eval_prompt_data and wait: eval/<name>, eval/<name>-pass@k, ...

        Idempotent per (job_id, rollout_id): a retried call joins the eval already running.
        """
        request = rollout_pb2.RunEvalRequest(config=config_to_proto(config), rollout_id=rollout_id,
                                             weight_version=weight_version)
        return dict(self.call(self.stub.RunEval, request, timeout_s=timeout_s, idempotent=True).metrics)

    def list_engines(self) -> tuple[list[EngineInfo], str]:
        """The pool's engines and the router URL."""
        reply = self.call(self.stub.ListEngines, rollout_pb2.ListEnginesRequest(), idempotent=True)
        engines = [EngineInfo(url=e.url, weight_version=e.weight_version, healthy=e.healthy) for e in reply.engines]
        return engines, reply.router_url

    def scale(self, replicas: int) -> PoolStatus:
        """Set the pool's desired number of engines (it gets there in the background); returns its state."""
        reply = self.call(self.stub.Scale, rollout_pb2.ScaleRequest(replicas=replicas), idempotent=True)
        return pool_status_from_proto(reply)

    def pool_status(self) -> PoolStatus:
        reply = self.call(self.stub.GetPoolStatus, rollout_pb2.GetPoolStatusRequest(), idempotent=True)
        return pool_status_from_proto(reply)

    def begin_weight_sync(self, weight_version: str, lora_name: str = "") -> WeightSyncPlan:
        """Tell the pool a broadcast of `weight_version` starts (of adapter `lora_name`'s, when set); it names the
        engines to include (and pauses their health checks until end_weight_sync)."""
        request = rollout_pb2.BeginWeightSyncRequest(weight_version=weight_version, lora_name=lora_name)
        reply = self.call(self.stub.BeginWeightSync, request, idempotent=True)
        return WeightSyncPlan(engine_urls=list(reply.engine_urls), snapshot_dir=reply.snapshot_dir)

    def end_weight_sync(self, weight_version: str, *, success: bool, engine_urls: list[str],
                        failed_urls: list[str] = (), snapshot_path: str = "", seconds: float = 0.0, num_bytes: int = 0,
                        error: str = "", lora_name: str = "") -> None:
        request = rollout_pb2.EndWeightSyncRequest(
            weight_version=weight_version, success=success, engine_urls=list(engine_urls),
            failed_urls=list(failed_urls), snapshot_path=snapshot_path, seconds=seconds, bytes=num_bytes, error=error,
            lora_name=lora_name)
        self.call(self.stub.EndWeightSync, request, idempotent=True)
