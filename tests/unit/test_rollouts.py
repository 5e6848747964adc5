"""services/trainer/driver/rollouts.py: the samples a rank trains on, as the buffer's groups hold them, each with the
images its tokens stand for."""

from __future__ import annotations

from services.common.gen.physarum.v1 import sample_pb2
from services.common.samples import Image, Sample, SampleGroup, group_from_proto, group_to_proto
from services.trainer.driver.rollouts import _flat


def image(tag: bytes) -> Image:
    return Image(data=tag, mime_type="image/png", width=1, height=1)


def test_a_sample_reads_its_groups_images_then_those_its_own_turns_added():
    prompt, seen = image(b"prompt"), image(b"observation")
    group = SampleGroup(group_id="j:0:0", job_id="j", rollout_id=0, prompt_index=0, epoch=0, images=[prompt],
                        samples=[Sample(tokens=[1, 2], response_length=1),
                                 Sample(tokens=[1, 3], response_length=1, index=1, observation_images=[seen])])
    wire = group_from_proto(sample_pb2.SampleGroup.FromString(group_to_proto(group).SerializeToString()))
    plain, multi_turn = _flat([wire])
    assert plain.images == [prompt] and plain.images is wire.images  # the group's list, shared, never copied
    assert multi_turn.images == [prompt, seen] and multi_turn.observation_images == [seen]
    text = SampleGroup(group_id="j:0:1", job_id="j", rollout_id=0, prompt_index=1, epoch=0,
                       samples=[Sample(tokens=[1, 2], response_length=1)])
    assert _flat([text])[0].images == []
