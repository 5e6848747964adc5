"""EncodedGroup: the buffer's wire-form groups index and decode exactly like the dataclass they come from."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from services.common.gen.physarum.v1 import sample_pb2
from services.common.samples import (
    Sample,
    SampleGroup,
    Status,
    encode_group,
    encoded_group_from_payload,
    encoded_group_from_proto,
    group_from_proto,
    group_payload_as_rollout,
    group_payload_to_proto,
    group_to_proto,
)


def make_group() -> SampleGroup:
    samples = [Sample(prompt="1+2=", tokens=[5, 6, 7, 8], response="3", response_length=2, label="3", reward=1.0,
                      rollout_log_probs=[-0.5, -0.25], status=Status.COMPLETED, weight_versions=versions, index=i)
               for i, versions in enumerate((["3", "4"], ["default"], ["5"]))]
    return SampleGroup(group_id="job:1:7", job_id="job", rollout_id=-2, prompt_index=7, epoch=1, samples=samples,
                       lease_id="lease-1")


def test_both_encodings_agree_and_decode_back():
    group = make_group()
    from_dataclass, from_proto = encode_group(group), encoded_group_from_proto(group_to_proto(group))
    assert from_dataclass == from_proto
    assert from_proto.weight_version_range == (-1, 5)  # "default" is an unknown age: -1
    assert (from_proto.group_id, from_proto.lease_id, from_proto.epoch) == ("job:1:7", "lease-1", 1)
    assert group_from_proto(group_payload_to_proto(from_proto.payload, -2)) == group


def test_a_stored_group_is_served_as_its_rollouts():
    msg = group_payload_to_proto(encode_group(make_group()).payload, 12)
    assert msg.rollout_id == 12 and len(msg.samples) == 3 and list(msg.samples[0].tokens) == [5, 6, 7, 8]


def test_a_payload_is_indexed_without_serializing_it_again():
    payload = group_to_proto(make_group()).SerializeToString()
    encoded = encoded_group_from_payload(payload)
    assert encoded.payload is payload and encoded == encode_group(make_group())


def test_the_rollout_id_appended_to_a_payload_wins_for_every_id():
    payload = encode_group(make_group()).payload
    for rollout_id in (0, 1, 127, 128, 2**31 - 1, -1, -2):
        msg = sample_pb2.SampleGroup.FromString(group_payload_as_rollout(payload, rollout_id))
        assert msg.rollout_id == rollout_id
        assert group_from_proto(msg).samples == make_group().samples


def test_a_payload_that_is_no_group_raises_decode_error():
    with pytest.raises(DecodeError):
        encoded_group_from_payload(b"\xff\xff\xff\xff\x0f garbage")
