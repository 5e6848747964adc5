from google.protobuf import struct_pb2 as _struct_pb2
from services.common.gen.physarum.v1 import sample_pb2 as _sample_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("rm_type", "custom_rm_path", "reward_key", "timeout_s", "samples", "args")
    RM_TYPE_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_RM_PATH_FIELD_NUMBER: _ClassVar[int]
    REWARD_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    rm_type: str
    custom_rm_path: str
    reward_key: str
    timeout_s: float
    samples: _containers.RepeatedCompositeFieldContainer[_sample_pb2.Sample]
    args: _struct_pb2.Struct
    def __init__(self, rm_type: _Optional[str] = ..., custom_rm_path: _Optional[str] = ..., reward_key: _Optional[str] = ..., timeout_s: _Optional[float] = ..., samples: _Optional[_Iterable[_Union[_sample_pb2.Sample, _Mapping]]] = ..., args: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Score(_message.Message):
    __slots__ = ("reward", "scores", "ok", "error")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reward: float
    scores: _containers.ScalarMap[str, float]
    ok: bool
    error: str
    def __init__(self, reward: _Optional[float] = ..., scores: _Optional[_Mapping[str, float]] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[Score]
    def __init__(self, scores: _Optional[_Iterable[_Union[Score, _Mapping]]] = ...) -> None: ...
