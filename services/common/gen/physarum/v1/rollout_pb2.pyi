from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_STATE_UNSPECIFIED: _ClassVar[RolloutState]
    ROLLOUT_STATE_UNKNOWN: _ClassVar[RolloutState]
    ROLLOUT_STATE_RUNNING: _ClassVar[RolloutState]
    ROLLOUT_STATE_DONE: _ClassVar[RolloutState]
    ROLLOUT_STATE_FAILED: _ClassVar[RolloutState]
ROLLOUT_STATE_UNSPECIFIED: RolloutState
ROLLOUT_STATE_UNKNOWN: RolloutState
ROLLOUT_STATE_RUNNING: RolloutState
ROLLOUT_STATE_DONE: RolloutState
ROLLOUT_STATE_FAILED: RolloutState

class RolloutConfig(_message.Message):
    __slots__ = ("job_id", "tokenizer_path", "rollout_batch_size", "n_samples_per_prompt", "rollout_temperature", "rollout_top_p", "rollout_top_k", "rollout_max_response_len", "rollout_stop", "rollout_stop_token_ids", "rm_type", "custom_rm_path", "reward_key", "reward_timeout_s", "loss_type", "lease_timeout_s", "args")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_TOP_P_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_MAX_RESPONSE_LEN_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_STOP_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RM_TYPE_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_RM_PATH_FIELD_NUMBER: _ClassVar[int]
    REWARD_KEY_FIELD_NUMBER: _ClassVar[int]
    REWARD_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_TYPE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tokenizer_path: str
    rollout_batch_size: int
    n_samples_per_prompt: int
    rollout_temperature: float
    rollout_top_p: float
    rollout_top_k: int
    rollout_max_response_len: int
    rollout_stop: _containers.RepeatedScalarFieldContainer[str]
    rollout_stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    rm_type: str
    custom_rm_path: str
    reward_key: str
    reward_timeout_s: float
    loss_type: str
    lease_timeout_s: float
    args: _struct_pb2.Struct
    def __init__(self, job_id: _Optional[str] = ..., tokenizer_path: _Optional[str] = ..., rollout_batch_size: _Optional[int] = ..., n_samples_per_prompt: _Optional[int] = ..., rollout_temperature: _Optional[float] = ..., rollout_top_p: _Optional[float] = ..., rollout_top_k: _Optional[int] = ..., rollout_max_response_len: _Optional[int] = ..., rollout_stop: _Optional[_Iterable[str]] = ..., rollout_stop_token_ids: _Optional[_Iterable[int]] = ..., rm_type: _Optional[str] = ..., custom_rm_path: _Optional[str] = ..., reward_key: _Optional[str] = ..., reward_timeout_s: _Optional[float] = ..., loss_type: _Optional[str] = ..., lease_timeout_s: _Optional[float] = ..., args: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class StartRolloutRequest(_message.Message):
    __slots__ = ("config", "rollout_id", "weight_version")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    config: RolloutConfig
    rollout_id: int
    weight_version: str
    def __init__(self, config: _Optional[_Union[RolloutConfig, _Mapping]] = ..., rollout_id: _Optional[int] = ..., weight_version: _Optional[str] = ...) -> None: ...

class StartRolloutResponse(_message.Message):
    __slots__ = ("already_running",)
    ALREADY_RUNNING_FIELD_NUMBER: _ClassVar[int]
    already_running: bool
    def __init__(self, already_running: _Optional[bool] = ...) -> None: ...

class GetRolloutStatusRequest(_message.Message):
    __slots__ = ("job_id", "rollout_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rollout_id: int
    def __init__(self, job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("state", "num_groups_done", "num_groups_target", "error", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_TARGET_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    state: RolloutState
    num_groups_done: int
    num_groups_target: int
    error: str
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, state: _Optional[_Union[RolloutState, str]] = ..., num_groups_done: _Optional[int] = ..., num_groups_target: _Optional[int] = ..., error: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("url", "weight_version", "healthy")
    URL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    url: str
    weight_version: str
    healthy: bool
    def __init__(self, url: _Optional[str] = ..., weight_version: _Optional[str] = ..., healthy: _Optional[bool] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines", "router_url")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    ROUTER_URL_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    router_url: str
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., router_url: _Optional[str] = ...) -> None: ...
