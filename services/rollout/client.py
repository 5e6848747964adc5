"""The rollout service's records (RolloutConfig, RolloutStatus, EngineInfo, PoolStatus), their proto conversion, and
its client.

Imports only the shared package, so the trainer can use it without pulling in the manager or the pool.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Literal

from services.common.config import NON_NEGATIVE, POSITIVE, PROBABILITY, REQUIRED, check_fields, field
from services.common.errors import InvalidArgument
from services.common.gen.physarum.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.grpc_client import GrpcClient
from services.common.samples import dict_to_struct, struct_to_dict
from services.reward.client import check_rm_type

LossType = Literal["policy_loss", "sft_loss", "custom_loss"]
# an eval dataset's own settings (slime's eval config names) -> the RolloutConfig field each replaces for it
EVAL_DATASET_SETTINGS = {"n_samples_per_eval_prompt": "n_samples_per_eval_prompt", "temperature": "eval_temperature",
                         "top_p": "eval_top_p", "top_k": "eval_top_k", "max_response_len": "eval_max_response_len",
                         "input_key": "eval_input_key", "label_key": "eval_label_key", "metadata_key": "metadata_key",
                         "rm_type": "rm_type", "custom_rm_path": "custom_rm_path"}


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """What the manager needs to know of a job (proto RolloutConfig). Field names are slime's flags; each setting's
    declaration here (default, help, rule) is the job spec's, and the trainer's TrainConfig shares the ones it needs.
    """

    job_id: str = field("", "the job's id", internal=True)
    tokenizer_path: str = field("", "the tokenizer (the job's hf_checkpoint; empty: the engines' model directory)",
                                internal=True)
    args: dict[str, Any] = field({}, "the whole job spec, for plugins (slime's `args`)", internal=True)
    rollout_batch_size: int = field(REQUIRED, "prompts (groups) per rollout", POSITIVE)
    n_samples_per_prompt: int = field(1, "samples per prompt; consecutive samples form one reward group", POSITIVE)
    rollout_temperature: float = field(1.0, "sampling temperature (the trainer divides logits by it too)",
                                       NON_NEGATIVE)
    rollout_top_p: float = field(1.0, "nucleus sampling threshold", PROBABILITY)
    rollout_top_k: int = field(-1, "top-k sampling (-1: off)")
    rollout_max_response_len: int = field(1024, "most tokens generated per sample", POSITIVE)
    rollout_stop: list[str] = field([], "stop strings")
    rollout_stop_token_ids: list[int] = field([], "stop token ids")
    rm_type: str = field("math", "built-in reward, slime's rm_hub: math, deepscaler, dapo, f1, gpqa, remote_rm, random "
                                 "(a boxed_ prefix scores the last \\boxed{}), or exact_match; a sample's "
                                 "metadata.rm_type wins")
    custom_rm_path: str = field("", "import path of async def reward(args, sample) -> float (or dict)")
    reward_key: str = field("", "train on sample.reward_scores[reward_key] when a reward function returns a dict")
    rm_url: str = field("", "rm_type remote_rm: the reward model's HTTP endpoint (POST prompt, response, label)")
    loss_mask_type: Literal["qwen", "qwen3", "distill"] = field(
        "qwen", "sft_loss on conversations: how the chat template marks the assistant turns that train")
    reward_timeout_s: float = field(10.0, "seconds a sample's reward may take", POSITIVE)
    loss_type: LossType = field("policy_loss", "policy_loss (RL), sft_loss (NLL of prompt + label, no generation) "
                                               "or custom_loss")
    # The job spec's user-facing default (slime has no such flag): a lease not acked in this time goes back.
    lease_timeout_s: float = field(60.0, "seconds before a leased prompt goes back to the buffer", POSITIVE)
    over_sampling_batch_size: int | None = field(
        None, "groups leased per refill, >= rollout_batch_size (None or 0: the missing ones)")
    dynamic_sampling_filter_path: str = field(
        "", "fn(args, samples) -> DynamicFilterOutput | bool, or a built-in filter's name")
    partial_rollout: bool = field(False, "groups aborted once the batch is full keep their tokens for the next "
                                         "rollout")
    mask_offpolicy_in_partial_rollout: bool = field(False, "an earlier rollout's tokens get loss_mask 0")
    custom_generate_function_path: str = field("", "async def generate(args, sample, sampling_params) -> Sample")
    group_rm: bool = field(False, "custom_rm_path is async def f(args, samples) -> list[float], once per group")
    eval_prompt_data: list[str] = field([], "eval datasets as name=path (slime's name path pairs are accepted)")
    n_samples_per_eval_prompt: int = field(1, "samples per eval prompt", POSITIVE)
    eval_temperature: float | None = field(None, "eval sampling temperature (None: rollout_temperature)",
                                           NON_NEGATIVE)
    eval_top_p: float | None = field(None, "eval nucleus threshold (None: rollout_top_p)", PROBABILITY)
    eval_max_response_len: int | None = field(None, "eval response limit (None: rollout_max_response_len)",
                                              POSITIVE)
    eval_top_k: int | None = field(None, "eval top-k sampling (None: rollout_top_k; -1: off)")
    eval_input_key: str | None = field(None, "the prompt's key in the eval datasets (None: input_key)")
    eval_label_key: str | None = field(None, "the label's key in the eval datasets (None: label_key)")
    eval_dataset_settings: dict[str, dict[str, Any]] = field(
        {}, "per eval dataset (by name), settings of its own over the eval_* keys, as slime's --eval-config datasets "
            "set them: " + ", ".join(EVAL_DATASET_SETTINGS))
    input_key: str = field("input", "the prompt's key in each data row")
    label_key: str = field("label", "the label's key in each data row (slime's default)")
    metadata_key: str = field("metadata", "the metadata's key in each data row")
    apply_chat_template: bool = field(False, "wrap each prompt in the tokenizer's chat template")
    max_inflight_groups: int | None = field(
        None, "fully_async: groups generating or waiting (None: rollout_batch_size); > 0 makes the manager stream")
    agent_function_path: str = field(
        "", "import path of async def agent(base_url, api_key, prompt) -> float | None, run per sample against its "
            "own session of the agent gateway (OpenAI and Anthropic APIs); a float return is the sample's reward")
    agent_timeout_s: float = field(600.0, "seconds an agent may run; its session then ends and the sample is the "
                                          "trajectory so far, truncated", POSITIVE)

    def __post_init__(self) -> None:
        if not self.job_id:
            raise InvalidArgument("rollout config: job_id must not be empty")
        check_fields(self, InvalidArgument, "rollout config")
        fallbacks = {"eval_temperature": self.rollout_temperature, "eval_top_p": self.rollout_top_p,
                     "eval_max_response_len": self.rollout_max_response_len, "over_sampling_batch_size": 0,
                     "eval_top_k": self.rollout_top_k, "eval_input_key": self.input_key,
                     "eval_label_key": self.label_key,
                     "max_inflight_groups": 0}
        for name, value in fallbacks.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.over_sampling_batch_size and self.over_sampling_batch_size < self.rollout_batch_size:
            raise InvalidArgument(f"rollout config: over_sampling_batch_size ({self.over_sampling_batch_size}) must "
                                  f"be >= rollout_batch_size ({self.rollout_batch_size}), or 0")
        if self.max_inflight_groups < 0:
            raise InvalidArgument(f"rollout config: max_inflight_groups must be >= 0, got {self.max_inflight_groups}")
        if 0 < self.max_inflight_groups < self.rollout_batch_size:
            raise InvalidArgument(f"rollout config: max_inflight_groups ({self.max_inflight_groups}) must be >= "
                                  f"rollout_batch_size ({self.rollout_batch_size})")
        if self.max_inflight_groups and self.partial_rollout:
            raise InvalidArgument("rollout config: partial_rollout does not apply to a fully_async stream (it never "
                                  "aborts groups to end a batch)")
        for entry in self.eval_prompt_data:
            name, _, path = entry.partition("=")
            if not name or not path:
                raise InvalidArgument(f"rollout config: eval_prompt_data entry {entry!r} is not 'name=path'")
        for name in self.eval_dataset_settings:
            if name not in self.eval_datasets:
                raise InvalidArgument(f"rollout config: eval_dataset_settings names {name!r}, which is not an eval "
                                      f"dataset ({', '.join(self.eval_datasets) or 'none'})")
            if self.eval_dataset_settings[name]:
                self.for_eval_dataset(name)
        if not self.custom_rm_path:
            if self.rm_type:
                check_rm_type(self.rm_type, where="rollout config")
            if self.rm_type.removeprefix("boxed_") == "remote_rm" and not self.rm_url:
                raise InvalidArgument("rollout config: rm_type remote_rm needs rm_url (the reward model's HTTP "
                                      "endpoint)")
        if self.group_rm and not self.custom_rm_path:
            raise InvalidArgument("rollout config: group_rm needs custom_rm_path (async def f(args, samples) -> "
                                  "list[float])")
        if self.agent_function_path and (self.custom_generate_function_path or self.partial_rollout):
            raise InvalidArgument("rollout config: agent_function_path runs the agent as the sample's generate "
                                  "function: leave custom_generate_function_path empty and partial_rollout off (an "
                                  "agent does not resume an aborted session)")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise InvalidArgument("rollout config: mask_offpolicy_in_partial_rollout needs partial_rollout")

    @property
    def eval_datasets(self) -> dict[str, str]:
        """eval_prompt_data as {name: path}, in order."""
        return dict(entry.split("=", 1) for entry in self.eval_prompt_data)

    def for_eval_dataset(self, name: str) -> RolloutConfig:
        """This config with eval dataset `name`'s own settings (eval_dataset_settings) over the eval_* keys; checked
        as any config is (a bad rm_type fails naming it)."""
        settings = self.eval_dataset_settings.get(name) or {}
        unknown = sorted(set(settings) - set(EVAL_DATASET_SETTINGS))
        if unknown:
            raise InvalidArgument(f"rollout config: eval_dataset_settings[{name!r}]: unknown settings {unknown}; "
                                  f"expected {', '.join(EVAL_DATASET_SETTINGS)}")
        hints = {f.name: f.type for f in dataclasses.fields(RolloutConfig)}
        values = {}
        for key, value in settings.items():
            if value is None:
                continue
            target = EVAL_DATASET_SETTINGS[key]
            integral = "int" in str(hints[target]) and isinstance(value, float) and value.is_integer()
            values[target] = int(value) if integral else value  # a proto Struct carries numbers as floats
        try:
            return dataclasses.replace(self, eval_dataset_settings={}, **values)
        except InvalidArgument as err:
            raise InvalidArgument(f"rollout config: eval_dataset_settings[{name!r}]: "
                                  f"{str(err).removeprefix('rollout config: ')}") from None


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

    def count(self, *states: EngineState) -> int:
        return sum(e.state in states for e in self.engines)


@dataclass
class WeightSyncPlan:
    """What the pool answers BeginWeightSync: the engines to broadcast to, and where to write a snapshot."""

    engine_urls: list[str]
    snapshot_dir: str = ""


SNAPSHOT_PREFIX = "weight_v"  # slime's update_weight_disk_dir layout: <snapshot_dir>/weight_v<version>


def snapshot_path(snapshot_dir: str | Path, version: str | int) -> Path:
    """Where the trainer writes the snapshot of weight version `version` (engines joining by disk load it there)."""
    return Path(snapshot_dir) / f"{SNAPSHOT_PREFIX}{version}"


def config_to_proto(config: RolloutConfig) -> rollout_pb2.RolloutConfig:
    values = dataclasses.asdict(config)
    return rollout_pb2.RolloutConfig(**{**values, "args": dict_to_struct(values["args"]),
                                        "eval_dataset_settings": dict_to_struct(values["eval_dataset_settings"])})


def config_from_proto(msg: rollout_pb2.RolloutConfig) -> RolloutConfig:
    """Raises InvalidArgument naming the bad field."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(RolloutConfig)}
    values.update(rollout_stop=list(msg.rollout_stop), rollout_stop_token_ids=list(msg.rollout_stop_token_ids),
                  args=struct_to_dict(msg.args), eval_prompt_data=list(msg.eval_prompt_data),
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
                      rest_url=msg.rest_url, events=events, weight_sync_in_progress=msg.weight_sync_in_progress)


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

    def begin_weight_sync(self, weight_version: str) -> WeightSyncPlan:
        """Tell the pool a broadcast of `weight_version` starts; it names the engines to include (and pauses their
        health checks until end_weight_sync)."""
        reply = self.call(self.stub.BeginWeightSync, rollout_pb2.BeginWeightSyncRequest(weight_version=weight_version),
                          idempotent=True)
        return WeightSyncPlan(engine_urls=list(reply.engine_urls), snapshot_dir=reply.snapshot_dir)

    def end_weight_sync(self, weight_version: str, *, success: bool, engine_urls: list[str],
                        failed_urls: list[str] = (), snapshot_path: str = "", seconds: float = 0.0, num_bytes: int = 0,
                        error: str = "") -> None:
        request = rollout_pb2.EndWeightSyncRequest(
            weight_version=weight_version, success=success, engine_urls=list(engine_urls),
            failed_urls=list(failed_urls), snapshot_path=snapshot_path, seconds=seconds, bytes=num_bytes, error=error)
        self.call(self.stub.EndWeightSync, request, idempotent=True)
