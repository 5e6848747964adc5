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

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_STARTING: _ClassVar[EngineState]
    ENGINE_STATE_JOINING: _ClassVar[EngineState]
    ENGINE_STATE_SERVING: _ClassVar[EngineState]
    ENGINE_STATE_DRAINING: _ClassVar[EngineState]
    ENGINE_STATE_FAILED: _ClassVar[EngineState]
ROLLOUT_STATE_UNSPECIFIED: RolloutState
ROLLOUT_STATE_UNKNOWN: RolloutState
ROLLOUT_STATE_RUNNING: RolloutState
ROLLOUT_STATE_DONE: RolloutState
ROLLOUT_STATE_FAILED: RolloutState
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_STARTING: EngineState
ENGINE_STATE_JOINING: EngineState
ENGINE_STATE_SERVING: EngineState
ENGINE_STATE_DRAINING: EngineState
ENGINE_STATE_FAILED: EngineState

class RolloutConfig(_message.Message):
    __slots__ = ("job_id", "tokenizer_path", "rollout_batch_size", "n_samples_per_prompt", "rollout_temperature", "rollout_top_p", "rollout_top_k", "rollout_max_response_len", "rollout_stop", "rollout_stop_token_ids", "rm_type", "custom_rm_path", "reward_key", "reward_timeout_s", "loss_type", "lease_timeout_s", "args", "over_sampling_batch_size", "dynamic_sampling_filter_path", "partial_rollout", "mask_offpolicy_in_partial_rollout", "custom_generate_function_path", "group_rm", "eval_prompt_data", "n_samples_per_eval_prompt", "eval_temperature", "eval_top_p", "eval_max_response_len", "input_key", "label_key", "metadata_key", "apply_chat_template", "multimodal_keys", "max_inflight_groups", "rm_url", "loss_mask_type", "eval_top_k", "eval_input_key", "eval_label_key", "eval_dataset_settings", "agent_function_path", "agent_timeout_s", "use_rollout_routing_replay", "opd_teacher_url", "opd_only", "rollout_function_path", "data_source_path", "buffer_filter_path", "int_args", "eval_function_path")
    class MultimodalKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
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
    OVER_SAMPLING_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_SAMPLING_FILTER_PATH_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    MASK_OFFPOLICY_IN_PARTIAL_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_GENERATE_FUNCTION_PATH_FIELD_NUMBER: _ClassVar[int]
    GROUP_RM_FIELD_NUMBER: _ClassVar[int]
    EVAL_PROMPT_DATA_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_PER_EVAL_PROMPT_FIELD_NUMBER: _ClassVar[int]
    EVAL_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    EVAL_TOP_P_FIELD_NUMBER: _ClassVar[int]
    EVAL_MAX_RESPONSE_LEN_FIELD_NUMBER: _ClassVar[int]
    INPUT_KEY_FIELD_NUMBER: _ClassVar[int]
    LABEL_KEY_FIELD_NUMBER: _ClassVar[int]
    METADATA_KEY_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RM_URL_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_TYPE_FIELD_NUMBER: _ClassVar[int]
    EVAL_TOP_K_FIELD_NUMBER: _ClassVar[int]
    EVAL_INPUT_KEY_FIELD_NUMBER: _ClassVar[int]
    EVAL_LABEL_KEY_FIELD_NUMBER: _ClassVar[int]
    EVAL_DATASET_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    AGENT_FUNCTION_PATH_FIELD_NUMBER: _ClassVar[int]
    AGENT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    USE_ROLLOUT_ROUTING_REPLAY_FIELD_NUMBER: _ClassVar[int]
    OPD_TEACHER_URL_FIELD_NUMBER: _ClassVar[int]
    OPD_ONLY_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FUNCTION_PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FILTER_PATH_FIELD_NUMBER: _ClassVar[int]
    INT_ARGS_FIELD_NUMBER: _ClassVar[int]
    EVAL_FUNCTION_PATH_FIELD_NUMBER: _ClassVar[int]
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
    over_sampling_batch_size: int
    dynamic_sampling_filter_path: str
    partial_rollout: bool
    mask_offpolicy_in_partial_rollout: bool
    custom_generate_function_path: str
    group_rm: bool
    eval_prompt_data: _containers.RepeatedScalarFieldContainer[str]
    n_samples_per_eval_prompt: int
    eval_temperature: float
    eval_top_p: float
    eval_max_response_len: int
    input_key: str
    label_key: str
    metadata_key: str
    apply_chat_template: bool
    multimodal_keys: _containers.ScalarMap[str, str]
    max_inflight_groups: int
    rm_url: str
    loss_mask_type: str
    eval_top_k: int
    eval_input_key: str
    eval_label_key: str
    eval_dataset_settings: _struct_pb2.Struct
    agent_function_path: str
    agent_timeout_s: float
    use_rollout_routing_replay: bool
    opd_teacher_url: str
    opd_only: bool
    rollout_function_path: str
    data_source_path: str
    buffer_filter_path: str
    int_args: _containers.RepeatedScalarFieldContainer[str]
    eval_function_path: str
    def __init__(self, job_id: _Optional[str] = ..., tokenizer_path: _Optional[str] = ..., rollout_batch_size: _Optional[int] = ..., n_samples_per_prompt: _Optional[int] = ..., rollout_temperature: _Optional[float] = ..., rollout_top_p: _Optional[float] = ..., rollout_top_k: _Optional[int] = ..., rollout_max_response_len: _Optional[int] = ..., rollout_stop: _Optional[_Iterable[str]] = ..., rollout_stop_token_ids: _Optional[_Iterable[int]] = ..., rm_type: _Optional[str] = ..., custom_rm_path: _Optional[str] = ..., reward_key: _Optional[str] = ..., reward_timeout_s: _Optional[float] = ..., loss_type: _Optional[str] = ..., lease_timeout_s: _Optional[float] = ..., args: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., over_sampling_batch_size: _Optional[int] = ..., dynamic_sampling_filter_path: _Optional[str] = ..., partial_rollout: _Optional[bool] = ..., mask_offpolicy_in_partial_rollout: _Optional[bool] = ..., custom_generate_function_path: _Optional[str] = ..., group_rm: _Optional[bool] = ..., eval_prompt_data: _Optional[_Iterable[str]] = ..., n_samples_per_eval_prompt: _Optional[int] = ..., eval_temperature: _Optional[float] = ..., eval_top_p: _Optional[float] = ..., eval_max_response_len: _Optional[int] = ..., input_key: _Optional[str] = ..., label_key: _Optional[str] = ..., metadata_key: _Optional[str] = ..., apply_chat_template: _Optional[bool] = ..., multimodal_keys: _Optional[_Mapping[str, str]] = ..., max_inflight_groups: _Optional[int] = ..., rm_url: _Optional[str] = ..., loss_mask_type: _Optional[str] = ..., eval_top_k: _Optional[int] = ..., eval_input_key: _Optional[str] = ..., eval_label_key: _Optional[str] = ..., eval_dataset_settings: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., agent_function_path: _Optional[str] = ..., agent_timeout_s: _Optional[float] = ..., use_rollout_routing_replay: _Optional[bool] = ..., opd_teacher_url: _Optional[str] = ..., opd_only: _Optional[bool] = ..., rollout_function_path: _Optional[str] = ..., data_source_path: _Optional[str] = ..., buffer_filter_path: _Optional[str] = ..., int_args: _Optional[_Iterable[str]] = ..., eval_function_path: _Optional[str] = ...) -> None: ...

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

class StopRolloutRequest(_message.Message):
    __slots__ = ("job_id", "rollout_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rollout_id: int
    def __init__(self, job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ...) -> None: ...

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

class RunEvalRequest(_message.Message):
    __slots__ = ("config", "rollout_id", "weight_version")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    config: RolloutConfig
    rollout_id: int
    weight_version: str
    def __init__(self, config: _Optional[_Union[RolloutConfig, _Mapping]] = ..., rollout_id: _Optional[int] = ..., weight_version: _Optional[str] = ...) -> None: ...

class RunEvalResponse(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

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

class ScaleRequest(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    def __init__(self, replicas: _Optional[int] = ...) -> None: ...

class GetPoolStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("name", "url", "state", "pid", "weight_version", "healthy", "load", "external")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    url: str
    state: EngineState
    pid: int
    weight_version: str
    healthy: bool
    load: int
    external: bool
    def __init__(self, name: _Optional[str] = ..., url: _Optional[str] = ..., state: _Optional[_Union[EngineState, str]] = ..., pid: _Optional[int] = ..., weight_version: _Optional[str] = ..., healthy: _Optional[bool] = ..., load: _Optional[int] = ..., external: _Optional[bool] = ...) -> None: ...

class ScaleEvent(_message.Message):
    __slots__ = ("time_s", "kind", "engine", "detail")
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    time_s: float
    kind: str
    engine: str
    detail: str
    def __init__(self, time_s: _Optional[float] = ..., kind: _Optional[str] = ..., engine: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("desired_replicas", "engines", "weight_version", "join_mode", "snapshot_dir", "router_url", "rest_url", "events", "weight_sync_in_progress", "adapter_versions")
    class AdapterVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DESIRED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOIN_MODE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    ROUTER_URL_FIELD_NUMBER: _ClassVar[int]
    REST_URL_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    desired_replicas: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    weight_version: str
    join_mode: str
    snapshot_dir: str
    router_url: str
    rest_url: str
    events: _containers.RepeatedCompositeFieldContainer[ScaleEvent]
    weight_sync_in_progress: bool
    adapter_versions: _containers.ScalarMap[str, str]
    def __init__(self, desired_replicas: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., weight_version: _Optional[str] = ..., join_mode: _Optional[str] = ..., snapshot_dir: _Optional[str] = ..., router_url: _Optional[str] = ..., rest_url: _Optional[str] = ..., events: _Optional[_Iterable[_Union[ScaleEvent, _Mapping]]] = ..., weight_sync_in_progress: _Optional[bool] = ..., adapter_versions: _Optional[_Mapping[str, str]] = ...) -> None: ...

class BeginWeightSyncRequest(_message.Message):
    __slots__ = ("weight_version", "lora_name")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    lora_name: str
    def __init__(self, weight_version: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class BeginWeightSyncResponse(_message.Message):
    __slots__ = ("engine_urls", "snapshot_dir")
    ENGINE_URLS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    engine_urls: _containers.RepeatedScalarFieldContainer[str]
    snapshot_dir: str
    def __init__(self, engine_urls: _Optional[_Iterable[str]] = ..., snapshot_dir: _Optional[str] = ...) -> None: ...

class EndWeightSyncRequest(_message.Message):
    __slots__ = ("weight_version", "success", "engine_urls", "failed_urls", "snapshot_path", "seconds", "bytes", "error", "lora_name")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URLS_FIELD_NUMBER: _ClassVar[int]
    FAILED_URLS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_PATH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    success: bool
    engine_urls: _containers.RepeatedScalarFieldContainer[str]
    failed_urls: _containers.RepeatedScalarFieldContainer[str]
    snapshot_path: str
    seconds: float
    bytes: int
    error: str
    lora_name: str
    def __init__(self, weight_version: _Optional[str] = ..., success: _Optional[bool] = ..., engine_urls: _Optional[_Iterable[str]] = ..., failed_urls: _Optional[_Iterable[str]] = ..., snapshot_path: _Optional[str] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., error: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class EndWeightSyncResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
