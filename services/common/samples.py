"""The Sample / SampleGroup / Prompt records as dataclasses, and their proto conversion (only here).

Fields follow slime's `Sample`; `metadata` is free-form plugin data that core code never reads.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format, struct_pb2

from services.common.gen.physarum.v1 import sample_pb2


class Status(enum.Enum):
    PENDING = sample_pb2.SAMPLE_STATUS_PENDING
    COMPLETED = sample_pb2.SAMPLE_STATUS_COMPLETED
    TRUNCATED = sample_pb2.SAMPLE_STATUS_TRUNCATED
    ABORTED = sample_pb2.SAMPLE_STATUS_ABORTED
    FAILED = sample_pb2.SAMPLE_STATUS_FAILED

    @classmethod
    def from_finish_reason(cls, finish_type: str) -> Status:
        """SGLang's finish_reason.type: stop -> COMPLETED, length -> TRUNCATED, abort -> ABORTED."""
        return {"stop": cls.COMPLETED, "length": cls.TRUNCATED, "abort": cls.ABORTED}.get(finish_type, cls.FAILED)


@dataclass
class Sample:
    prompt: str = ""
    prompt_messages: list[dict[str, Any]] = field(default_factory=list)  # as Prompt.messages
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = ""  # slime keeps a dataset label's JSON type: a string, a number, a dict, a list
    reward: float = 0.0
    reward_scores: dict[str, float] = field(default_factory=dict)
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[str] = field(default_factory=list)
    group_index: int = 0
    index: int = 0
    reward_error: str = ""
    # slime's remaining fields that travel with a sample
    rollout_id: int | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] = field(default_factory=list)
    train_metadata: dict[str, Any] | None = None
    custom_rm_path: str = ""
    generate_function_path: str = ""
    # SGLang's routed experts: [len(tokens) - 1, num layers, top-k] flattened; empty unless the job asked for them
    rollout_routed_experts: list[int] = field(default_factory=list)
    lora_name: str = ""  # the LoRA adapter its requests named (a LoRA job's id); "" for the base model
    # the images its tokens stand for: its group's list (SampleGroup.images), shared by the group's samples and never
    # stored per sample (sample_to_proto leaves it out; the trainer's feed sets it from the group), then its own
    images: list[Image] = field(default_factory=list)
    # the images its own turns add after its prompt's (an environment's observations), stored with the sample
    observation_images: list[Image] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


@dataclass
class SampleGroup:
    group_id: str
    job_id: str
    rollout_id: int
    prompt_index: int
    epoch: int
    samples: list[Sample]
    lease_id: str = ""
    images: list[Image] = field(default_factory=list)  # the prompt's, once for all its samples


# slime's MultimodalTypes: the placeholder of each modality in a prompt's text (multimodal_keys). Only images are read.
MULTIMODAL_PLACEHOLDERS = {"image": "<image>"}


@dataclass(frozen=True)
class Image:
    """An image of a prompt: its encoded file bytes as read (checked at load), never re-encoded on the way."""

    data: bytes
    mime_type: str
    width: int
    height: int


@dataclass
class Prompt:
    job_id: str
    index: int
    epoch: int
    prompt: str = ""
    # A message's content is a string, or (a prompt with images) a list of parts {"type": "text", "text": ...} and
    # {"type": "image"}, the k-th image part standing for images[k].
    messages: list[dict[str, Any]] = field(default_factory=list)
    label: Any = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    lease_id: str = ""
    images: list[Image] = field(default_factory=list)


def weight_version_range(samples: list[Sample]) -> tuple[int, int]:
    """The oldest and newest policy versions the samples' tokens came from; an unknown or non-numeric version
    (SGLang's initial "default") counts as -1, so a staleness bound never passes a group of unknown age."""
    return _version_range(v for s in samples for v in s.weight_versions)


def _version_range(weight_versions: Iterable[str]) -> tuple[int, int]:
    versions = [int(v) if v.lstrip("-").isdigit() else -1 for v in weight_versions] or [-1]
    return min(versions), max(versions)


@dataclass(frozen=True)
class EncodedGroup:
    """A SampleGroup in its wire form (a serialized proto SampleGroup) with the fields the buffer indexes it by: the
    buffer stores and serves groups without turning every token list into Python objects and back."""

    group_id: str
    job_id: str
    rollout_id: int
    prompt_index: int
    epoch: int
    lease_id: str
    weight_version_range: tuple[int, int]
    payload: bytes
    num_tokens: int = 0  # over its samples: what a rollout's shares are balanced by (services.common.shares)


def encode_group(group: SampleGroup, encoded_samples: Sequence[sample_pb2.Sample | None] = ()) -> EncodedGroup:
    """The group in its wire form. `encoded_samples` holds, beside each sample, its proto when it was converted
    already (for the reward service, with its reward set since): the group is built from those, not converted again."""
    encoded = list(encoded_samples) or [None] * len(group.samples)
    if len(encoded) != len(group.samples):
        raise ValueError(f"group {group.group_id}: {len(encoded)} encoded samples for {len(group.samples)} samples")
    msg = sample_pb2.SampleGroup(group_id=group.group_id, job_id=group.job_id, rollout_id=group.rollout_id,
                                 prompt_index=group.prompt_index, epoch=group.epoch, lease_id=group.lease_id)
    # extend, not the constructor's samples=: half the time for a group of small samples
    msg.samples.extend(m or sample_to_proto(sample) for sample, m in zip(group.samples, encoded, strict=True))
    if group.images:
        msg.images.extend(image_to_proto(image) for image in group.images)
    return EncodedGroup(group.group_id, group.job_id, group.rollout_id, group.prompt_index, group.epoch,
                        group.lease_id, weight_version_range(group.samples), msg.SerializeToString(),
                        sum(len(s.tokens) for s in group.samples))


def encoded_group_from_proto(msg: sample_pb2.SampleGroup) -> EncodedGroup:
    """A SampleGroup message in its wire form, indexed by what it holds."""
    return EncodedGroup(msg.group_id, msg.job_id, msg.rollout_id, msg.prompt_index, msg.epoch, msg.lease_id,
                        _version_range(v for s in msg.samples for v in s.weight_versions), msg.SerializeToString(),
                        sum(len(s.tokens) for s in msg.samples))


def set_reward_fields(msg: sample_pb2.Sample, sample: Sample) -> None:
    """Carry what scoring sets on a sample (reward, reward_scores, reward_error) over to its proto."""
    msg.reward = sample.reward
    if msg.reward_scores or sample.reward_scores:  # most samples have none: a map's clear and update cost more
        msg.reward_scores.clear()
        msg.reward_scores.update(sample.reward_scores)
    if msg.reward_error != sample.reward_error:
        msg.reward_error = sample.reward_error


def group_id_for(job_id: str, epoch: int, prompt_index: int) -> str:
    """The idempotency key of the group answering one prompt of one epoch."""
    return f"{job_id}:{epoch}:{prompt_index}"


def dict_to_struct(data: dict[str, Any] | None) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    if data:
        struct.update(data)
    return struct


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    return json_format.MessageToDict(struct)


def _messages_to_proto(messages: list[dict[str, Any]]) -> list[sample_pb2.ChatMessage]:
    return [sample_pb2.ChatMessage(role=m["role"], content=m["content"]) if isinstance(m["content"], str) else
            sample_pb2.ChatMessage(role=m["role"], parts=[_part_to_proto(p) for p in m["content"]])
            for m in messages]


def _part_to_proto(part: dict[str, Any]) -> sample_pb2.ContentPart:
    return sample_pb2.ContentPart(type="text", text=part["text"]) if part["type"] == "text" else \
        sample_pb2.ContentPart(type=part["type"])


def _messages_from_proto(messages) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} if not m.parts else
            {"role": m.role, "content": [{"type": "text", "text": p.text} if p.type == "text" else {"type": p.type}
                                         for p in m.parts]}
            for m in messages]


def image_to_proto(image: Image) -> sample_pb2.Image:
    return sample_pb2.Image(data=image.data, mime_type=image.mime_type, width=image.width, height=image.height)


def image_from_proto(msg: sample_pb2.Image) -> Image:
    return Image(data=msg.data, mime_type=msg.mime_type, width=msg.width, height=msg.height)


def count_image_parts(messages: list[dict[str, Any]]) -> int:
    """How many images the messages' image parts stand for."""
    return sum(1 for m in messages if not isinstance(m["content"], str)
               for p in m["content"] if p["type"] == "image")


def label_to_proto(label: Any) -> dict[str, str]:
    """The proto's (label, label_json) pair: a string as it is, anything else (None included) as JSON."""
    return {"label": label} if isinstance(label, str) else {"label_json": json.dumps(label)}


def label_from_proto(msg: sample_pb2.Sample | sample_pb2.Prompt) -> Any:
    return json.loads(msg.label_json) if msg.label_json else msg.label


def sample_to_proto(sample: Sample, new: Callable[..., sample_pb2.Sample] = sample_pb2.Sample) -> sample_pb2.Sample:
    """The sample's proto, made by `new`: a repeated field's `add` builds it in place in a message (appending a
    built one copies it)."""
    # Only fields that hold something are set: each default passed to the constructor (an empty Struct, map, list or
    # string) cost more than a demo sample's tokens, and a rollout converts thousands of samples. `_value_` is the
    # member's value without the `value` property's descriptor call.
    msg = new(prompt=sample.prompt, tokens=sample.tokens, response=sample.response,
              response_length=sample.response_length, status=sample.status._value_, index=sample.index)
    if isinstance(sample.label, str):
        msg.label = sample.label
    else:
        msg.label_json = json.dumps(sample.label)
    if sample.reward:
        msg.reward = sample.reward
    if sample.loss_mask:
        msg.loss_mask.extend(sample.loss_mask)
    if sample.rollout_log_probs:
        msg.rollout_log_probs.extend(sample.rollout_log_probs)
    if sample.weight_versions:
        msg.weight_versions.extend(sample.weight_versions)
    if sample.group_index:
        msg.group_index = sample.group_index
    if sample.prompt_messages:
        msg.prompt_messages.extend(_messages_to_proto(sample.prompt_messages))
    if sample.reward_scores:
        msg.reward_scores.update(sample.reward_scores)
    if sample.metadata:
        msg.metadata.update(sample.metadata)
    if sample.reward_error:
        msg.reward_error = sample.reward_error
    if sample.rollout_id is not None:
        msg.rollout_id = sample.rollout_id  # optional: 0 is kept apart from unset
    if sample.remove_sample:
        msg.remove_sample = True
    if sample.teacher_log_probs:
        msg.teacher_log_probs.extend(sample.teacher_log_probs)
    if sample.train_metadata is not None:
        msg.train_metadata.SetInParent()  # an empty dict stays a dict, apart from None
        msg.train_metadata.update(sample.train_metadata)
    if sample.custom_rm_path:
        msg.custom_rm_path = sample.custom_rm_path
    if sample.generate_function_path:
        msg.generate_function_path = sample.generate_function_path
    if sample.rollout_routed_experts:
        msg.rollout_routed_experts.extend(sample.rollout_routed_experts)
    if sample.lora_name:
        msg.lora_name = sample.lora_name
    if sample.observation_images:
        msg.observation_images.extend(image_to_proto(image) for image in sample.observation_images)
    return msg


def sample_from_proto(msg: sample_pb2.Sample) -> Sample:
    return Sample(
        prompt=msg.prompt, prompt_messages=_messages_from_proto(msg.prompt_messages) if msg.prompt_messages else [],
        tokens=msg.tokens[:], response=msg.response, response_length=msg.response_length,
        label=json.loads(msg.label_json) if msg.label_json else msg.label, reward=msg.reward,
        reward_scores=dict(msg.reward_scores) if msg.reward_scores else {}, loss_mask=msg.loss_mask[:],
        rollout_log_probs=msg.rollout_log_probs[:], status=_STATUSES.get(msg.status) or Status(msg.status),
        metadata=struct_to_dict(msg.metadata) if msg.HasField("metadata") else {},
        weight_versions=msg.weight_versions[:], group_index=msg.group_index, index=msg.index,
        reward_error=msg.reward_error, rollout_id=msg.rollout_id if msg.HasField("rollout_id") else None,
        remove_sample=msg.remove_sample, teacher_log_probs=msg.teacher_log_probs[:] if msg.teacher_log_probs else [],
        train_metadata=struct_to_dict(msg.train_metadata) if msg.HasField("train_metadata") else None,
        custom_rm_path=msg.custom_rm_path, generate_function_path=msg.generate_function_path,
        rollout_routed_experts=msg.rollout_routed_experts[:] if msg.rollout_routed_experts else [],
        lora_name=msg.lora_name,
        observation_images=[image_from_proto(i) for i in msg.observation_images] if msg.observation_images else [])


_STATUSES = {0: Status.PENDING} | {status.value: status for status in Status}  # unset (0) reads as PENDING


def group_to_proto(group: SampleGroup) -> sample_pb2.SampleGroup:
    return sample_pb2.SampleGroup(
        group_id=group.group_id, job_id=group.job_id, rollout_id=group.rollout_id,
        prompt_index=group.prompt_index, epoch=group.epoch, lease_id=group.lease_id,
        samples=[sample_to_proto(s) for s in group.samples], images=[image_to_proto(i) for i in group.images])


def group_from_proto(msg: sample_pb2.SampleGroup) -> SampleGroup:
    return SampleGroup(
        group_id=msg.group_id, job_id=msg.job_id, rollout_id=msg.rollout_id, prompt_index=msg.prompt_index,
        epoch=msg.epoch, lease_id=msg.lease_id, samples=[sample_from_proto(s) for s in msg.samples],
        images=[image_from_proto(i) for i in msg.images])


def prompt_to_proto(prompt: Prompt) -> sample_pb2.Prompt:
    return sample_pb2.Prompt(
        job_id=prompt.job_id, index=prompt.index, epoch=prompt.epoch, prompt=prompt.prompt,
        messages=_messages_to_proto(prompt.messages), **label_to_proto(prompt.label),
        metadata=dict_to_struct(prompt.metadata), lease_id=prompt.lease_id,
        images=[image_to_proto(i) for i in prompt.images])


def prompt_from_proto(msg: sample_pb2.Prompt) -> Prompt:
    return Prompt(
        job_id=msg.job_id, index=msg.index, epoch=msg.epoch, prompt=msg.prompt,
        messages=_messages_from_proto(msg.messages), label=label_from_proto(msg), metadata=struct_to_dict(msg.metadata),
        lease_id=msg.lease_id, images=[image_from_proto(i) for i in msg.images])
