"""A data source's own prompts in the buffer (AppendPrompts) against a real Redis: stored once per position, served
once each with no second epoch, and restored from a checkpoint like a dataset's."""

from __future__ import annotations

import uuid

import pytest

from services.common.errors import FailedPrecondition
from services.common.samples import Prompt, Sample, SampleGroup, group_id_for
from tests.integration.test_buffer import running_buffer_client


@pytest.fixture(scope="module")
def client(redis_url):
    with running_buffer_client(redis_url) as client:
        yield client


def made(*texts: str) -> list[Prompt]:
    return [Prompt(job_id="", index=0, epoch=0, prompt=text, label=text.upper()) for text in texts]


def new_job() -> str:
    return f"source-{uuid.uuid4().hex[:8]}"


def test_positions_already_stored_keep_their_first_prompt(client):
    job = new_job()
    assert client.append_prompts(job, 0, made("a", "b")) == (2, 2)
    assert client.append_prompts(job, 1, made("B-again", "c")) == (1, 3)  # position 1 is stored: only c is new
    assert client.append_prompts(job, 0, made("a", "b", "c")) == (0, 3)
    with pytest.raises(FailedPrecondition, match="past the 3 stored"):
        client.append_prompts(job, 4, made("e"))
    leased = client.lease_prompts(job, 0, 10, lease_timeout_s=60)
    assert [(p.index, p.epoch, p.prompt, p.label) for p in leased] == [(0, 0, "a", "A"), (1, 0, "b", "B"),
                                                                          (2, 0, "c", "C")]
    assert client.lease_prompts(job, 0, 5, lease_timeout_s=60) == []  # no second epoch of a source's prompts
    client.append_prompts(job, 3, made("d"))
    assert [p.prompt for p in client.lease_prompts(job, 0, 5, lease_timeout_s=60)] == ["d"]


def test_a_files_dataset_is_replaced_until_its_prompts_are_served(client, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "q0"}\n{"input": "q1"}\n')
    unserved, served = new_job(), new_job()
    for job in (unserved, served):
        client.load_dataset(job, str(path), rollout_shuffle=True)
    assert client.append_prompts(unserved, 0, made("x")) == (1, 1)
    assert [p.prompt for p in client.lease_prompts(unserved, 0, 5, lease_timeout_s=60)] == ["x"]
    assert client.load_dataset(unserved, str(path)).already_loaded  # the trainer resuming loads nothing again
    with pytest.raises(FailedPrecondition, match="past the 0 stored"):
        client.append_prompts(served, 1, made("x"))  # refused before anything is replaced
    assert client.stats(served).num_prompts == 2
    client.lease_prompts(served, 0, 1, lease_timeout_s=60)
    with pytest.raises(FailedPrecondition, match="loaded from a file"):
        client.append_prompts(served, 0, made("x"))


def test_a_source_position_is_kept_per_rollout(client):
    job = new_job()
    assert client.load_source_position(job, 3) == 0
    client.save_source_position(job, 3, 12)
    assert (client.load_source_position(job, 3), client.load_source_position(job, 4)) == (12, 0)


def test_a_restored_job_serves_again_what_was_not_trained(client):
    job = new_job()
    client.append_prompts(job, 0, made("p0", "p1"))
    first = client.lease_prompts(job, 0, 2, lease_timeout_s=60)
    client.put_groups([SampleGroup(group_id=group_id_for(job, p.epoch, p.index), job_id=job, rollout_id=0,
                                   prompt_index=p.index, epoch=p.epoch, lease_id=p.lease_id,
                                   samples=[Sample(tokens=[1, 2], response_length=1)]) for p in first])
    state = client.save_state(job, rollout_id=0)
    assert (state.num_prompts, state.cursor, state.generated) == (2, 2, True)  # the cursor at the end
    client.append_prompts(job, 2, made("p2", "p3"))  # rollout 1 after the checkpoint: leased, never trained
    assert [p.prompt for p in client.lease_prompts(job, 1, 2, lease_timeout_s=60)] == ["p2", "p3"]
    client.restore_state(job, state)
    client.append_prompts(job, 2, made("p2-again", "p3-again"))  # the source, loaded, yields them again
    assert [p.prompt for p in client.lease_prompts(job, 1, 4, lease_timeout_s=60)] == ["p2", "p3"]
