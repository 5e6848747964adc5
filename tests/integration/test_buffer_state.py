"""The buffer's data-source state for checkpoints: SaveState / RestoreState against a real Redis.

A job stopped after a checkpoint and restored must lease exactly the prompts a never-stopped job leases, whatever
the stopped job had written or leased after the checkpoint (groups stay stored once; leases come back).
"""

from __future__ import annotations

import json
import uuid

import pytest

from services.buffer.client import STREAM_ROLLOUT_ID, BufferClient, DataSourceState
from services.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from services.common.samples import Prompt, Sample, SampleGroup, group_id_for
from tests.integration.test_buffer import running_buffer_client

BATCH = 3


@pytest.fixture(scope="module")
def client(redis_url):
    with running_buffer_client(redis_url) as client:
        yield client


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("state") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(10)))
    return str(path)


def new_job(client: BufferClient, dataset: str, seed: int = 7) -> str:
    job_id = f"state-{uuid.uuid4().hex[:8]}"
    client.load_dataset(job_id, dataset, rollout_shuffle=True, rollout_seed=seed)
    return job_id


def write(client: BufferClient, rollout_id: int, prompts: list[Prompt]) -> None:
    client.put_groups([SampleGroup(group_id=group_id_for(p.job_id, p.epoch, p.index), job_id=p.job_id,
                                   rollout_id=rollout_id, prompt_index=p.index, epoch=p.epoch,
                                   samples=[Sample(tokens=[1, 2], response_length=1)], lease_id=p.lease_id)
                       for p in prompts])


def rollout(client: BufferClient, job_id: str, rollout_id: int, num_written: int = BATCH) -> list[Prompt]:
    """What the manager does for one rollout: lease what is missing, write `num_written` of the leased groups."""
    missing = BATCH - client.count_groups(job_id, rollout_id)
    prompts = client.lease_prompts(job_id, rollout_id, missing, lease_timeout_s=60) if missing > 0 else []
    write(client, rollout_id, prompts[:num_written])
    return prompts


def trained(client: BufferClient, job_id: str, rollout_id: int) -> list[tuple[int, int]]:
    """The (epoch, prompt index) of each group the trainer gets for a rollout, in its order."""
    return sorted((g.epoch, g.prompt_index) for g in client.get_batch(job_id, rollout_id, BATCH, timeout_s=1))


def test_a_restored_job_leases_what_a_never_stopped_job_leases(client, dataset):
    reference = new_job(client, dataset)
    for rollout_id in range(6):  # 18 prompts of a 10-prompt dataset: crosses into epoch 1
        rollout(client, reference, rollout_id)
    expected = [trained(client, reference, r) for r in range(6)]

    job = new_job(client, dataset)
    for rollout_id in range(2):
        rollout(client, job, rollout_id)
    state = client.save_state(job, rollout_id=1)
    assert (state.epoch, state.cursor, state.leased, state.pending) == (0, 6, [], [])
    # The stopped job went on: rollout 2 written, rollout 3 half written (past the epoch's end), rollout 4 leased.
    rollout(client, job, 2)
    rollout(client, job, 3, num_written=1)
    rollout(client, job, 4, num_written=0)
    assert client.restore_state(job, state) == (0, 5)  # 2 leases of rollout 3, 3 of rollout 4
    stats = client.stats(job)
    assert (stats.epoch, stats.cursor, stats.num_leased, stats.num_returned) == (0, 6, 0, 0)
    for rollout_id in range(2, 6):
        rollout(client, job, rollout_id)
    assert [trained(client, job, r) for r in range(6)] == expected


def test_pending_leased_and_returned_slots_come_back_first(client, dataset):
    job = new_job(client, dataset)
    rollout(client, job, 0)
    # Rollout 1 was under way at the checkpoint: one group written, one lease returned, one outstanding.
    written, returned, leased = client.lease_prompts(job, 1, 3, lease_timeout_s=60)
    write(client, 1, [written])
    client.return_prompts(job, [returned.lease_id])
    state = client.save_state(job, rollout_id=0)
    slot = lambda p: f"{p.epoch}:{p.index}"  # noqa: E731
    assert (state.pending, state.leased, state.returned) == ([slot(written)], [slot(leased)], [slot(returned)])
    assert DataSourceState.from_dict(json.loads(json.dumps(state.to_dict()))) == state

    # Into a new job on the same dataset: nothing is stored there, so all three are served first, in that order.
    fresh = new_job(client, dataset)
    assert client.restore_state(fresh, state) == (3, 0)
    again = client.lease_prompts(fresh, 1, 4, lease_timeout_s=60)
    assert [slot(p) for p in again[:3]] == [slot(written), slot(leased), slot(returned)]
    reference = new_job(client, dataset)
    assert slot(again[3]) == slot(client.lease_prompts(reference, 0, 7, lease_timeout_s=60)[6])

    # Into the same job: the written group stays stored and is not served again; the lease is dropped.
    assert client.restore_state(job, state) == (2, 1)
    assert [slot(p) for p in client.lease_prompts(job, 1, 2, lease_timeout_s=60)] == [slot(leased), slot(returned)]


def test_a_stream_group_refused_as_stale_after_the_checkpoint_is_served_again_after_a_restore(client, dataset):
    """fully_async: a group waits in the stream at the checkpoint, is then refused as stale (deleted, its prompt
    queued), and the job restores the checkpoint: the prompt must not be lost with the queue."""
    job = new_job(client, dataset)
    waiting = client.lease_prompts(job, STREAM_ROLLOUT_ID, 1, lease_timeout_s=60)
    write(client, STREAM_ROLLOUT_ID, waiting)  # version -1: "unknown", stale for any bound
    state = client.save_state(job, rollout_id=0)
    assert state.pending == [f"{waiting[0].epoch}:{waiting[0].index}"]
    with pytest.raises(DeadlineExceeded):
        client.take_batch(job, 1, 1, min_weight_version=0, timeout_s=0.1)
    assert client.stats(job).num_returned == 1
    assert client.restore_state(job, state) == (1, 0)
    assert [p.index for p in client.lease_prompts(job, 1, 1, lease_timeout_s=60)] == [waiting[0].index]


def test_restore_checks_the_dataset_and_the_state(client, dataset):
    job = new_job(client, dataset)
    state = client.save_state(job, rollout_id=-1)
    other = new_job(client, dataset, seed=8)
    with pytest.raises(FailedPrecondition, match="rollout_seed=8"):
        client.restore_state(other, state)
    with pytest.raises(NotFound, match="no dataset"):
        client.restore_state("never-loaded", state)
    with pytest.raises(NotFound, match="no dataset"):
        client.save_state("never-loaded", 0)
    bad = DataSourceState(**{**state.to_dict(), "returned": ["3"]})
    with pytest.raises(InvalidArgument, match="bad slot '3'"):
        client.restore_state(job, bad)
    with pytest.raises(InvalidArgument, match="cursor 10 out of range"):
        client.restore_state(job, DataSourceState(**{**state.to_dict(), "cursor": 10}))
