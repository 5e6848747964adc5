"""samples.py: every Sample field survives the proto round trip, empty and set alike."""

from __future__ import annotations

import pytest

from services.common.gen.physarum.v1 import sample_pb2
from services.common.samples import Image, Sample, Status, sample_from_proto, sample_to_proto


def full_sample() -> Sample:
    return Sample(prompt="p", prompt_messages=[{"role": "user", "content": "1+2="}], tokens=[1, 2, 3], response="3",
                  response_length=1, label={"answer": 3}, reward=0.5, reward_scores={"acc": 1.0, "fmt": 0.0},
                  loss_mask=[1], rollout_log_probs=[-0.125], status=Status.TRUNCATED,
                  metadata={"rm_type": "math", "nested": {"k": [1.5, "x"]}}, weight_versions=["4", "5"],
                  group_index=2, index=7, reward_error="boom", rollout_id=0, remove_sample=True,
                  teacher_log_probs=[-0.5], train_metadata={}, custom_rm_path="m.f", generate_function_path="m.g",
                  rollout_routed_experts=[0, 3, 1, 2],
                  observation_images=[Image(data=b"\x89PNG...", mime_type="image/png", width=3, height=2)])


def test_every_field_round_trips():
    sample = full_sample()
    back = sample_from_proto(sample_pb2.Sample.FromString(sample_to_proto(sample).SerializeToString()))
    assert back == sample
    assert back.rollout_id == 0 and back.train_metadata == {}  # set to falsy values, not absent


def test_defaults_round_trip_as_defaults():
    msg = sample_to_proto(Sample())
    assert not msg.HasField("metadata") and not msg.HasField("train_metadata") and not msg.HasField("rollout_id")
    back = sample_from_proto(msg)
    assert back == Sample() and back.train_metadata is None and back.rollout_id is None
    assert type(back.tokens) is list and type(back.rollout_log_probs) is list


def test_a_string_label_stays_a_string_and_none_stays_none():
    assert sample_from_proto(sample_to_proto(Sample(label="12"))).label == "12"
    assert sample_from_proto(sample_to_proto(Sample(label=None))).label is None


def test_an_unknown_status_is_refused_by_name():
    with pytest.raises(ValueError, match="99"):
        sample_from_proto(sample_pb2.Sample(status=99))
