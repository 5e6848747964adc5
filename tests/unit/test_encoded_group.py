"""EncodedGroup: a group's wire form indexes and decodes exactly like the dataclass it comes from, and one built
from the protos its samples were sent to the reward service as is the same group."""

from __future__ import annotations

import pytest

from services.common.gen.physarum.v1 import sample_pb2
from services.common.samples import (
    Sample,
    SampleGroup,
    Status,
    encode_group,
    encoded_group_from_proto,
    group_from_proto,
    group_to_proto,
    sample_to_proto,
    set_reward_fields,
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
    assert from_proto.num_tokens == 12
    assert group_from_proto(sample_pb2.SampleGroup.FromString(from_proto.payload)) == group


def test_a_group_built_from_its_samples_scored_protos_is_the_group_scored():
    group = make_group()
    unscored = [Sample(**{**vars(s), "reward": 0.0}) for s in group.samples]
    sent = [sample_to_proto(s) for s in unscored]  # what the reward service was sent
    for sample, msg, reward in zip(unscored, sent, (1.0, 0.0, 0.5), strict=True):
        sample.reward, sample.reward_scores = reward, {"acc": reward}
        sample.reward_error = "" if reward else "no answer"
        set_reward_fields(msg, sample)
    shared = encode_group(SampleGroup(**{**vars(group), "samples": unscored}), sent)
    fresh = encode_group(SampleGroup(**{**vars(group), "samples": unscored}))
    decoded = group_from_proto(sample_pb2.SampleGroup.FromString(shared.payload))
    assert decoded == group_from_proto(sample_pb2.SampleGroup.FromString(fresh.payload))
    assert [s.reward for s in decoded.samples] == [1.0, 0.0, 0.5]
    assert [s.reward_error for s in decoded.samples] == ["", "no answer", ""]
    assert decoded.samples[2].reward_scores == {"acc": 0.5}
    assert (shared.num_tokens, shared.weight_version_range) == (fresh.num_tokens, fresh.weight_version_range)


def test_a_sample_without_a_proto_beside_it_is_converted():
    group = make_group()
    sent = [None, sample_to_proto(group.samples[1]), None]
    decoded = group_from_proto(sample_pb2.SampleGroup.FromString(encode_group(group, sent).payload))
    assert decoded == group


def test_protos_that_are_not_one_per_sample_are_refused():
    group = make_group()
    with pytest.raises(ValueError, match="1 encoded samples for 3 samples"):
        encode_group(group, [sample_to_proto(group.samples[0])])


def test_a_groups_images_travel_once_in_its_wire_form():
    from services.common.samples import Image

    images = [Image(data=b"\x89PNG fake", mime_type="image/png", width=3, height=2)]
    group = SampleGroup(**{**vars(make_group()), "images": images})
    encoded = encode_group(group)
    assert encoded == encoded_group_from_proto(group_to_proto(group))
    decoded = group_from_proto(sample_pb2.SampleGroup.FromString(encoded.payload))
    assert decoded.images == images and decoded == group
    assert encoded.payload.count(b"\x89PNG fake") == 1  # once for the group, not per sample
