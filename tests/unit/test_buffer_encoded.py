"""The buffer's encoded groups, through the generated messages: a writer's group travels beside its header, the
store checks its bytes are that group, and a served group belongs to the rollout it was served for."""

from __future__ import annotations

import dataclasses

import pytest

from services.buffer.client import decode_served_group, group_header
from services.buffer.server import encoded_group_from_wire, served_group
from services.buffer.store import _check_payload
from services.common.errors import InvalidArgument
from services.common.gen.physarum.v1 import buffer_pb2
from services.common.samples import (
    Sample,
    SampleGroup,
    encode_group,
    encoded_group_from_proto,
    group_from_proto,
    group_to_proto,
)


def groups() -> list[SampleGroup]:
    return [SampleGroup(group_id=f"job:0:{i}", job_id="job", rollout_id=-2, prompt_index=i, epoch=0, lease_id=f"l{i}",
                        samples=[Sample(tokens=[1, 2, i], response_length=1, weight_versions=[str(i)])])
            for i in range(3)]


def test_a_put_request_carries_each_group_beside_its_header():
    encoded = [encode_group(g) for g in groups()]
    assert [g.num_tokens for g in encoded] == [3, 3, 3] and encoded[2].weight_version_range == (2, 2)
    request = buffer_pb2.PutGroupsRequest(encoded_groups=[
        buffer_pb2.EncodedGroup(header=group_header(e), sample_group=e.payload) for e in encoded])
    received = buffer_pb2.PutGroupsRequest.FromString(request.SerializeToString())
    assert [encoded_group_from_wire(g) for g in received.encoded_groups] == encoded


def test_a_writer_that_sends_messages_has_them_indexed_as_they_are():
    request = buffer_pb2.PutGroupsRequest(groups=[group_to_proto(g) for g in groups()])
    received = buffer_pb2.PutGroupsRequest.FromString(request.SerializeToString())
    assert [encoded_group_from_proto(g) for g in received.groups] == [encode_group(g) for g in groups()]


def test_the_store_refuses_bytes_that_are_not_the_headers_group():
    first, second = (encode_group(g) for g in groups()[:2])
    _check_payload(first)
    with pytest.raises(InvalidArgument, match="its bytes are another group's"):
        _check_payload(dataclasses.replace(first, payload=second.payload))
    with pytest.raises(InvalidArgument, match="its bytes are another group's"):  # same group, another rollout
        _check_payload(dataclasses.replace(first, rollout_id=3))
    with pytest.raises(InvalidArgument, match="no serialized SampleGroup"):
        _check_payload(dataclasses.replace(first, payload=b"\xff\xff\xff\xff\x0f garbage"))


def test_a_served_group_belongs_to_the_rollout_it_was_served_for():
    payloads = [encode_group(g).payload for g in groups()]  # stream groups: written as rollout -2
    reply = buffer_pb2.TakeBatchResponse(encoded_groups=payloads, num_stale_dropped=2)
    received = buffer_pb2.TakeBatchResponse.FromString(reply.SerializeToString())
    decoded = [decode_served_group(p, 7) for p in received.encoded_groups]
    assert received.num_stale_dropped == 2 and [g.rollout_id for g in decoded] == [7, 7, 7]
    assert [g.samples for g in decoded] == [g.samples for g in groups()]
    as_messages = [group_from_proto(served_group(p, 7)) for p in payloads]  # for a reader that asks for messages
    assert as_messages == decoded
