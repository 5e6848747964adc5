from services.common.gen.physarum.v1 import sample_pb2 as _sample_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadDatasetRequest(_message.Message):
    __slots__ = ("job_id", "path", "input_key", "label_key", "metadata_key", "apply_chat_template", "rollout_shuffle", "rollout_seed", "multimodal_keys")
    class MultimodalKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    INPUT_KEY_FIELD_NUMBER: _ClassVar[int]
    LABEL_KEY_FIELD_NUMBER: _ClassVar[int]
    METADATA_KEY_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_SEED_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_KEYS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    path: str
    input_key: str
    label_key: str
    metadata_key: str
    apply_chat_template: bool
    rollout_shuffle: bool
    rollout_seed: int
    multimodal_keys: _containers.ScalarMap[str, str]
    def __init__(self, job_id: _Optional[str] = ..., path: _Optional[str] = ..., input_key: _Optional[str] = ..., label_key: _Optional[str] = ..., metadata_key: _Optional[str] = ..., apply_chat_template: _Optional[bool] = ..., rollout_shuffle: _Optional[bool] = ..., rollout_seed: _Optional[int] = ..., multimodal_keys: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LoadDatasetResponse(_message.Message):
    __slots__ = ("num_prompts", "num_skipped", "errors", "already_loaded")
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    num_prompts: int
    num_skipped: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    already_loaded: bool
    def __init__(self, num_prompts: _Optional[int] = ..., num_skipped: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ..., already_loaded: _Optional[bool] = ...) -> None: ...

class LeasePromptsRequest(_message.Message):
    __slots__ = ("job_id", "rollout_id", "count", "lease_timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rollout_id: int
    count: int
    lease_timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ..., count: _Optional[int] = ..., lease_timeout_s: _Optional[float] = ...) -> None: ...

class LeasePromptsResponse(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_sample_pb2.Prompt]
    def __init__(self, prompts: _Optional[_Iterable[_Union[_sample_pb2.Prompt, _Mapping]]] = ...) -> None: ...

class ReturnPromptsRequest(_message.Message):
    __slots__ = ("job_id", "lease_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReturnPromptsResponse(_message.Message):
    __slots__ = ("num_returned",)
    NUM_RETURNED_FIELD_NUMBER: _ClassVar[int]
    num_returned: int
    def __init__(self, num_returned: _Optional[int] = ...) -> None: ...

class PutGroupsRequest(_message.Message):
    __slots__ = ("groups", "headers", "encoded_groups")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_sample_pb2.SampleGroup]
    headers: _containers.RepeatedCompositeFieldContainer[GroupHeader]
    encoded_groups: _containers.RepeatedCompositeFieldContainer[EncodedGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[_sample_pb2.SampleGroup, _Mapping]]] = ..., headers: _Optional[_Iterable[_Union[GroupHeader, _Mapping]]] = ..., encoded_groups: _Optional[_Iterable[_Union[EncodedGroup, _Mapping]]] = ...) -> None: ...

class EncodedGroup(_message.Message):
    __slots__ = ("header", "sample_group")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_GROUP_FIELD_NUMBER: _ClassVar[int]
    header: GroupHeader
    sample_group: bytes
    def __init__(self, header: _Optional[_Union[GroupHeader, _Mapping]] = ..., sample_group: _Optional[bytes] = ...) -> None: ...

class GroupHeader(_message.Message):
    __slots__ = ("group_id", "job_id", "rollout_id", "prompt_index", "epoch", "lease_id", "oldest_weight_version", "newest_weight_version", "num_tokens")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OLDEST_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEWEST_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    job_id: str
    rollout_id: int
    prompt_index: int
    epoch: int
    lease_id: str
    oldest_weight_version: int
    newest_weight_version: int
    num_tokens: int
    def __init__(self, group_id: _Optional[str] = ..., job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ..., prompt_index: _Optional[int] = ..., epoch: _Optional[int] = ..., lease_id: _Optional[str] = ..., oldest_weight_version: _Optional[int] = ..., newest_weight_version: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PutGroupsResponse(_message.Message):
    __slots__ = ("num_written", "num_duplicate")
    NUM_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    num_written: int
    num_duplicate: int
    def __init__(self, num_written: _Optional[int] = ..., num_duplicate: _Optional[int] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("job_id", "rollout_id", "num_groups", "timeout_s", "share", "encoded")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rollout_id: int
    num_groups: int
    timeout_s: float
    share: Share
    encoded: bool
    def __init__(self, job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ..., num_groups: _Optional[int] = ..., timeout_s: _Optional[float] = ..., share: _Optional[_Union[Share, _Mapping]] = ..., encoded: _Optional[bool] = ...) -> None: ...

class GetBatchResponse(_message.Message):
    __slots__ = ("groups", "encoded_groups")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_sample_pb2.SampleGroup]
    encoded_groups: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, groups: _Optional[_Iterable[_Union[_sample_pb2.SampleGroup, _Mapping]]] = ..., encoded_groups: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Share(_message.Message):
    __slots__ = ("index", "count", "step_groups")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STEP_GROUPS_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    step_groups: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., step_groups: _Optional[int] = ...) -> None: ...

class TakeBatchRequest(_message.Message):
    __slots__ = ("job_id", "rollout_id", "num_groups", "min_weight_version", "stale_policy", "timeout_s", "max_weight_version", "share", "encoded")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALE_POLICY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rollout_id: int
    num_groups: int
    min_weight_version: int
    stale_policy: str
    timeout_s: float
    max_weight_version: int
    share: Share
    encoded: bool
    def __init__(self, job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ..., num_groups: _Optional[int] = ..., min_weight_version: _Optional[int] = ..., stale_policy: _Optional[str] = ..., timeout_s: _Optional[float] = ..., max_weight_version: _Optional[int] = ..., share: _Optional[_Union[Share, _Mapping]] = ..., encoded: _Optional[bool] = ...) -> None: ...

class TakeBatchResponse(_message.Message):
    __slots__ = ("groups", "num_stale_dropped", "num_stale_regenerated", "encoded_groups")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_STALE_REGENERATED_FIELD_NUMBER: _ClassVar[int]
    ENCODED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_sample_pb2.SampleGroup]
    num_stale_dropped: int
    num_stale_regenerated: int
    encoded_groups: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, groups: _Optional[_Iterable[_Union[_sample_pb2.SampleGroup, _Mapping]]] = ..., num_stale_dropped: _Optional[int] = ..., num_stale_regenerated: _Optional[int] = ..., encoded_groups: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CountGroupsRequest(_message.Message):
    __slots__ = ("job_id", "rollout_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rollout_id: int
    def __init__(self, job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ...) -> None: ...

class CountGroupsResponse(_message.Message):
    __slots__ = ("num_groups",)
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_groups: int
    def __init__(self, num_groups: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class BufferStats(_message.Message):
    __slots__ = ("num_prompts", "epoch", "cursor", "num_leased", "num_returned", "num_groups")
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURNED_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_prompts: int
    epoch: int
    cursor: int
    num_leased: int
    num_returned: int
    num_groups: int
    def __init__(self, num_prompts: _Optional[int] = ..., epoch: _Optional[int] = ..., cursor: _Optional[int] = ..., num_leased: _Optional[int] = ..., num_returned: _Optional[int] = ..., num_groups: _Optional[int] = ...) -> None: ...

class SaveStateRequest(_message.Message):
    __slots__ = ("job_id", "rollout_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rollout_id: int
    def __init__(self, job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ...) -> None: ...

class DataSourceState(_message.Message):
    __slots__ = ("num_prompts", "shuffle", "seed", "epoch", "cursor", "returned", "leased", "pending", "rollout_id", "generated")
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    num_prompts: int
    shuffle: bool
    seed: int
    epoch: int
    cursor: int
    returned: _containers.RepeatedScalarFieldContainer[str]
    leased: _containers.RepeatedScalarFieldContainer[str]
    pending: _containers.RepeatedScalarFieldContainer[str]
    rollout_id: int
    generated: bool
    def __init__(self, num_prompts: _Optional[int] = ..., shuffle: _Optional[bool] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., cursor: _Optional[int] = ..., returned: _Optional[_Iterable[str]] = ..., leased: _Optional[_Iterable[str]] = ..., pending: _Optional[_Iterable[str]] = ..., rollout_id: _Optional[int] = ..., generated: _Optional[bool] = ...) -> None: ...

class RestoreStateRequest(_message.Message):
    __slots__ = ("job_id", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: DataSourceState
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[DataSourceState, _Mapping]] = ...) -> None: ...

class RestoreStateResponse(_message.Message):
    __slots__ = ("num_requeued", "num_leases_dropped")
    NUM_REQUEUED_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    num_requeued: int
    num_leases_dropped: int
    def __init__(self, num_requeued: _Optional[int] = ..., num_leases_dropped: _Optional[int] = ...) -> None: ...

class AppendPromptsRequest(_message.Message):
    __slots__ = ("job_id", "position", "prompts")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    position: int
    prompts: _containers.RepeatedCompositeFieldContainer[_sample_pb2.Prompt]
    def __init__(self, job_id: _Optional[str] = ..., position: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[_sample_pb2.Prompt, _Mapping]]] = ...) -> None: ...

class AppendPromptsResponse(_message.Message):
    __slots__ = ("num_appended", "num_prompts")
    NUM_APPENDED_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    num_appended: int
    num_prompts: int
    def __init__(self, num_appended: _Optional[int] = ..., num_prompts: _Optional[int] = ...) -> None: ...

class SourcePositionRequest(_message.Message):
    __slots__ = ("job_id", "rollout_id", "position")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rollout_id: int
    position: int
    def __init__(self, job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class SourcePosition(_message.Message):
    __slots__ = ("position", "found")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    position: int
    found: bool
    def __init__(self, position: _Optional[int] = ..., found: _Optional[bool] = ...) -> None: ...
