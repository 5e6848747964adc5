from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SampleStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLE_STATUS_UNSPECIFIED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_PENDING: _ClassVar[SampleStatus]
    SAMPLE_STATUS_COMPLETED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_TRUNCATED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_ABORTED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_FAILED: _ClassVar[SampleStatus]
SAMPLE_STATUS_UNSPECIFIED: SampleStatus
SAMPLE_STATUS_PENDING: SampleStatus
SAMPLE_STATUS_COMPLETED: SampleStatus
SAMPLE_STATUS_TRUNCATED: SampleStatus
SAMPLE_STATUS_ABORTED: SampleStatus
SAMPLE_STATUS_FAILED: SampleStatus

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("type", "text")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    type: str
    text: str
    def __init__(self, type: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "mime_type", "width", "height")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    width: int
    height: int
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt", "prompt_messages", "tokens", "response", "response_length", "label", "reward", "reward_scores", "loss_mask", "rollout_log_probs", "status", "metadata", "weight_versions", "group_index", "index", "reward_error", "label_json", "rollout_id", "remove_sample", "teacher_log_probs", "train_metadata", "custom_rm_path", "generate_function_path", "rollout_routed_experts", "lora_name", "observation_images")
    class RewardScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_SCORES_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REWARD_ERROR_FIELD_NUMBER: _ClassVar[int]
    LABEL_JSON_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    REMOVE_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_METADATA_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_RM_PATH_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FUNCTION_PATH_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_IMAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    response: str
    response_length: int
    label: str
    reward: float
    reward_scores: _containers.ScalarMap[str, float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    rollout_log_probs: _containers.RepeatedScalarFieldContainer[float]
    status: SampleStatus
    metadata: _struct_pb2.Struct
    weight_versions: _containers.RepeatedScalarFieldContainer[str]
    group_index: int
    index: int
    reward_error: str
    label_json: str
    rollout_id: int
    remove_sample: bool
    teacher_log_probs: _containers.RepeatedScalarFieldContainer[float]
    train_metadata: _struct_pb2.Struct
    custom_rm_path: str
    generate_function_path: str
    rollout_routed_experts: _containers.RepeatedScalarFieldContainer[int]
    lora_name: str
    observation_images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, prompt: _Optional[str] = ..., prompt_messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tokens: _Optional[_Iterable[int]] = ..., response: _Optional[str] = ..., response_length: _Optional[int] = ..., label: _Optional[str] = ..., reward: _Optional[float] = ..., reward_scores: _Optional[_Mapping[str, float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., rollout_log_probs: _Optional[_Iterable[float]] = ..., status: _Optional[_Union[SampleStatus, str]] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., weight_versions: _Optional[_Iterable[str]] = ..., group_index: _Optional[int] = ..., index: _Optional[int] = ..., reward_error: _Optional[str] = ..., label_json: _Optional[str] = ..., rollout_id: _Optional[int] = ..., remove_sample: _Optional[bool] = ..., teacher_log_probs: _Optional[_Iterable[float]] = ..., train_metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., custom_rm_path: _Optional[str] = ..., generate_function_path: _Optional[str] = ..., rollout_routed_experts: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ..., observation_images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class SampleGroup(_message.Message):
    __slots__ = ("group_id", "job_id", "rollout_id", "prompt_index", "epoch", "lease_id", "samples", "images")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    job_id: str
    rollout_id: int
    prompt_index: int
    epoch: int
    lease_id: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, group_id: _Optional[str] = ..., job_id: _Optional[str] = ..., rollout_id: _Optional[int] = ..., prompt_index: _Optional[int] = ..., epoch: _Optional[int] = ..., lease_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("job_id", "index", "epoch", "prompt", "messages", "label", "metadata", "lease_id", "label_json", "images")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_JSON_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    index: int
    epoch: int
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    label: str
    metadata: _struct_pb2.Struct
    lease_id: str
    label_json: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, job_id: _Optional[str] = ..., index: _Optional[int] = ..., epoch: _Optional[int] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., label: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., lease_id: _Optional[str] = ..., label_json: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...
