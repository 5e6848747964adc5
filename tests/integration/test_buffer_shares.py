"""Each trainer rank reads its own share of a rollout from the buffer (GetBatch and TakeBatch with a Share), and the
groups pass through as the bytes the writer encoded."""

from __future__ import annotations

import dataclasses

import pytest

from services.buffer.client import STREAM_ROLLOUT_ID, BufferClient
from services.common.errors import InvalidArgument
from services.common.samples import Sample, SampleGroup, encode_group, group_id_for
from services.common.shares import Share
from tests.integration.test_buffer import buffer_addr, client, job_id, loaded, loop_thread  # noqa: F401 - fixtures

TOKENS = [100, 90, 10, 20, 5, 5, 5, 5]  # per group (two samples of half as many tokens each)


def groups_of(buffer: BufferClient, job: str, rollout_id: int, write_as: int) -> list[SampleGroup]:
    prompts = buffer.lease_prompts(job, write_as, len(TOKENS), 60.0)
    return [SampleGroup(group_id=group_id_for(job, p.epoch, p.index), job_id=job, rollout_id=write_as,
                        prompt_index=p.index, epoch=p.epoch, lease_id=p.lease_id,
                        samples=[Sample(tokens=[p.index] * (n // 2), response_length=1, index=j) for j in range(2)])
            for p, n in zip(prompts, TOKENS, strict=True)]


def test_each_rank_gets_whole_groups_balanced_by_tokens(client, loaded):  # noqa: F811
    client.put_groups(groups_of(client, loaded, 0, 0))
    shares = [client.get_batch(loaded, 0, 8, timeout_s=5.0, share=Share(index=k, count=2, step_groups=4))
              for k in range(2)]
    # as services.common.shares deals them: step 1 (prompts 0-3: 100, 90, 10, 20 tokens) -> {0, 2} and {1, 3},
    # step 2 (5 tokens each) -> {4, 6} and {5, 7}
    assert [[g.prompt_index for g in share] for share in shares] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert all(len(g.samples) == 2 and g.rollout_id == 0 for share in shares for g in share)
    whole = client.get_batch(loaded, 0, 8, timeout_s=5.0)
    assert [g.prompt_index for g in whole] == list(range(8))  # unset: the whole rollout, in write order
    with pytest.raises(InvalidArgument, match=r"step_groups \(6\) must be a multiple of the share count \(4\)"):
        client.get_batch_encoded(loaded, 0, 8, timeout_s=5.0, share=_unchecked(index=0, count=4, step_groups=6))


def test_take_batch_answers_its_share_and_the_others_read_theirs(client, loaded):  # noqa: F811
    client.put_groups(groups_of(client, loaded, 3, STREAM_ROLLOUT_ID))
    share = Share(index=0, count=2, step_groups=4)
    taken = client.take_batch(loaded, 3, 8, min_weight_version=-1, timeout_s=5.0, share=share)
    assert [g.prompt_index for g in taken.groups] == [0, 2, 4, 6]
    other = client.get_batch(loaded, 3, 8, timeout_s=5.0, share=Share(index=1, count=2, step_groups=4))
    assert [g.prompt_index for g in other] == [1, 3, 5, 7] and {g.rollout_id for g in other} == {3}


def test_encoded_groups_are_stored_and_served_as_their_bytes(client, loaded):  # noqa: F811
    encoded = [encode_group(g) for g in groups_of(client, loaded, 1, 1)]
    assert client.put_groups(encoded).num_written == 8
    served = client.get_batch_encoded(loaded, 1, 8, timeout_s=5.0)
    # the stored bytes as the writer encoded them
    assert [s[:len(e.payload)] for s, e in zip(served, encoded, strict=True)] == [e.payload for e in encoded]


def _unchecked(**fields):
    """A share the client does not check, to see the server refuse it."""
    share = object.__new__(Share)
    for key, value in fields.items():
        object.__setattr__(share, key, value)
    return share


def test_a_group_whose_bytes_are_another_groups_is_refused(client, loaded):  # noqa: F811
    first, second = (encode_group(g) for g in groups_of(client, loaded, 2, 2)[:2])
    with pytest.raises(InvalidArgument, match=r"its bytes are another group's"):
        client.put_groups([dataclasses.replace(first, payload=second.payload)])
    assert client.put_groups([first]).num_written == 1
