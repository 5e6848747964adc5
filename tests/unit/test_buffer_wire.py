"""services/buffer/wire.py: the wire views decode and encode exactly as the messages clients send and receive."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from services.buffer.client import group_header
from services.buffer.wire import decode_put_groups
from services.common.gen.physarum.v1 import buffer_pb2
from services.common.samples import (
    Sample,
    SampleGroup,
    encode_group,
    group_from_proto,
    group_id_field,
    group_payload_as_rollout,
    group_to_proto,
)


def groups() -> list[SampleGroup]:
    return [SampleGroup(group_id=f"job:0:{i}", job_id="job", rollout_id=-2, prompt_index=i, epoch=0, lease_id=f"l{i}",
                        samples=[Sample(tokens=[1, 2, i], response_length=1, weight_versions=[str(i)])])
            for i in range(3)]


def test_a_put_request_decodes_into_its_groups_bytes_and_keys():
    request = buffer_pb2.PutGroupsRequest(groups=[group_to_proto(g) for g in groups()])
    assert decode_put_groups(request.SerializeToString()) == [encode_group(g) for g in groups()]


def test_a_put_request_with_headers_is_indexed_by_them_unparsed():
    encoded = [encode_group(g) for g in groups()]
    assert [g.num_tokens for g in encoded] == [3, 3, 3] and encoded[2].weight_version_range == (2, 2)
    garbage = b"not a SampleGroup"  # never parsed: the store checks only that the bytes start with the group_id
    request = buffer_pb2.EncodedPutGroupsRequest(groups=[e.payload for e in encoded[:2]] + [garbage],
                                                 headers=[group_header(e) for e in encoded])
    decoded = decode_put_groups(request.SerializeToString())
    assert decoded[:2] == encoded[:2] and decoded[2].payload == garbage and decoded[2].group_id == "job:0:2"
    assert all(e.payload.startswith(group_id_field(e.group_id)) for e in encoded)
    assert not garbage.startswith(group_id_field("job:0:2"))
    with pytest.raises(ValueError, match="2 headers for 3 groups"):
        decode_put_groups(buffer_pb2.EncodedPutGroupsRequest(groups=[e.payload for e in encoded],
                                                             headers=request.headers[:2]).SerializeToString())


def test_a_put_request_with_a_malformed_group_does_not_decode():
    request = buffer_pb2.EncodedPutGroupsRequest(groups=[group_to_proto(groups()[0]).SerializeToString(), b"\xff"])
    with pytest.raises(DecodeError):
        decode_put_groups(request.SerializeToString())


def test_the_encoded_reply_reads_as_get_batch_and_take_batch_replies():
    served = [group_payload_as_rollout(encode_group(g).payload, 7) for g in groups()]
    data = buffer_pb2.EncodedGroupsResponse(groups=served, num_stale_dropped=2).SerializeToString()
    take = buffer_pb2.TakeBatchResponse.FromString(data)
    assert take.num_stale_dropped == 2 and [group_from_proto(g).rollout_id for g in take.groups] == [7, 7, 7]
    get = buffer_pb2.GetBatchResponse.FromString(buffer_pb2.EncodedGroupsResponse(groups=served).SerializeToString())
    assert [group_from_proto(g).samples for g in get.groups] == [g.samples for g in groups()]
