"""Two trainer ranks (processes, gloo) each read their own share of a rollout from the real buffer: no sample
travels from rank 0 to another rank, the shares are whole groups balanced by tokens, and the rollout metrics the
ranks agree on are those of the whole rollout."""

from __future__ import annotations

import json

import pytest

from services.buffer.client import STREAM_ROLLOUT_ID, BufferClient
from services.buffer.server import stop_server
from services.common.samples import Sample, SampleGroup, Status, group_id_for
from services.trainer.distributed.parallel import World
from tests.integration.test_buffer import LoopThread, start_buffer
from tests.integration.workers import run_ranks

JOB = "rollout-ranks"
TOKENS = [9, 8, 1, 2, 3, 3, 3, 3]  # per sample of each group (two samples a group)


@pytest.fixture(scope="module")
def buffer_addr(redis_url):
    loop_thread = LoopThread()
    server = start_buffer(loop_thread, redis_url)
    yield f"127.0.0.1:{server.port}"
    loop_thread.run(stop_server(server, grace_s=0))
    loop_thread.close()


def write_rollouts(buffer: BufferClient, tmp_path) -> None:
    """Rollout 0 (sync) and the stream that fully_async takes rollout 1 from, as a manager writes them."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(16)))
    buffer.load_dataset(JOB, str(data))
    for rollout_id in (0, STREAM_ROLLOUT_ID):
        prompts = buffer.lease_prompts(JOB, rollout_id, len(TOKENS), 60.0)
        buffer.put_groups([SampleGroup(
            group_id=group_id_for(JOB, p.epoch, p.index), job_id=JOB, rollout_id=rollout_id, prompt_index=p.index,
            epoch=p.epoch, lease_id=p.lease_id, samples=[
                Sample(tokens=[p.index] * n, response_length=1, reward=float(j), status=Status.COMPLETED,
                       weight_versions=["0"], index=j) for j in range(2)])
            for p, n in zip(prompts, TOKENS, strict=True)])


@pytest.fixture(scope="module")
def ranks(buffer_addr, tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout-ranks")
    with BufferClient(buffer_addr, timeout_s=10.0) as buffer:
        write_rollouts(buffer, out)
    run_ranks("tests.integration.rollout_ranks", str(out), buffer_addr, JOB, log_dir=out, timeout_s=120)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


# Hand-dealt shares (services.common.shares), groups named by prompt index, in group_id order, two steps of 4.
# sync, prompts 0-7 (a group holds 2 x TOKENS tokens): step 1: 18, 16, 2, 4 -> 0 to rank 0, 1 to rank 1, 3 to
# rank 1 (16 < 18), 2 to rank 0 (rank 1 full); step 2 (all 6) alternates.
# fully_async, prompts 8-15, in group_id order 10, 11, 12, 13 | 14, 15, 8, 9 (ids are strings): step 1: 2, 4, 6, 6
# -> 12 to rank 0, 13 to rank 1, 11 to rank 0 (a tie goes to rank 0), 10 to rank 1; step 2: 6, 6, 18, 16 -> 8 to
# rank 0, 9 to rank 1, 14 to rank 1, 15 to rank 0.
SHARES = {"sync": [[0, 2, 4, 6], [1, 3, 5, 7]], "fully_async": [[8, 11, 12, 15], [9, 10, 13, 14]]}


@pytest.mark.parametrize("mode", sorted(SHARES))
def test_each_rank_reads_its_own_share_and_rank0_broadcasts_no_sample(ranks, mode):
    # rank 0's broadcasts are control results (None, metrics), never samples
    assert ranks[0]["broadcasts"] and not [b for b in ranks[0]["broadcasts"] if "Sample" in b]
    assert [sorted({tokens[0] for tokens in rank["got"][mode]["tokens"]}) for rank in ranks] == SHARES[mode]
    assert [len(rank["got"][mode]["tokens"]) for rank in ranks] == [8, 8]  # whole groups of 2 samples
    # both ranks report the whole rollout's metrics: 16 samples, rewards 0 and 1 in each group
    for rank in ranks:
        metrics = rank["got"][mode]["metrics"]
        assert metrics["rollout/reward_mean"] == pytest.approx(0.5)
        assert metrics["rollout/reward_std"] == pytest.approx(0.5)


def test_a_rank_that_cannot_read_its_share_ends_the_rollout_on_every_rank(ranks):
    for rank in ranks:
        assert rank["got"]["aborted"] == ("rank 1 could not read its share of rollout 0: Unavailable: buffer: "
                                          "connection refused")


def test_a_sample_broadcast_from_rank0_is_refused():
    """The guard the run above passes: rank 0's pickled broadcast path refuses samples (checked before sending)."""
    world = World(rank=0, world_size=2)
    with pytest.raises(TypeError, match="rank 0 broadcast a Sample"):
        world.broadcast((True, [Sample(tokens=[1])]))
