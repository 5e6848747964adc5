"""The trainer's ranks without a process group: a rollout's split across ranks, and the single-rank World."""

import pytest

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.common.shares import Share
from services.trainer.distributed.parallel import World, rollout_share, shard_rollout


def rollout(num_samples: int, tokens: list[int] | None = None) -> list[Sample]:
    """Groups of 2 samples; group g's samples hold tokens[g] tokens each (1 when not given)."""
    return [Sample(tokens=[0] * (tokens[i // 2] if tokens else 1), group_index=i // 2, index=i % 2)
            for i in range(num_samples)]


def ids(samples: list[Sample]) -> list[tuple[int, int]]:
    return [(s.group_index, s.index) for s in samples]


def test_each_rank_gets_an_equal_count_of_whole_groups_of_every_step_balanced_by_tokens():
    # 9 groups of 2; steps of 8 samples (4 groups): the last group fills no step. Step 1's groups hold 50, 40, 5, 10
    # tokens a sample: largest first to the lighter rank with room, 0 -> rank 0, 1 -> rank 1, 3 -> rank 1,
    # 2 -> rank 0 (rank 1 is full). Step 2 is even: 4, 6 -> rank 0 and 5, 7 -> rank 1.
    samples = rollout(18, tokens=[50, 40, 5, 10, 1, 1, 1, 1, 1])
    share = [rollout_share(rank=r, world_size=2, global_batch_size=8, n_samples_per_prompt=2) for r in range(2)]
    assert share[1] == Share(index=1, count=2, step_groups=4)
    shards = [shard_rollout(samples, share[r], n_samples_per_prompt=2) for r in range(2)]
    assert [sorted({g for g, _ in ids(shard)}) for shard in shards] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert all(len(shard) == 8 for shard in shards)
    assert rollout_share(rank=0, world_size=1, global_batch_size=8, n_samples_per_prompt=2) == Share()
    assert shard_rollout(samples, Share(), n_samples_per_prompt=2) == samples


def test_a_step_that_does_not_split_into_whole_groups_is_rejected():
    with pytest.raises(InvalidArgument, match=r"global_batch_size \(6\) must be a multiple of trainer ranks × "
                                              r"n_samples_per_prompt \(2 × 2\)"):
        rollout_share(rank=0, world_size=2, global_batch_size=6, n_samples_per_prompt=2)


def test_the_single_rank_world_runs_rank0_work_in_place():
    world = World()
    assert not world.distributed
    assert world.broadcast({"a": 1}) == {"a": 1}
    assert world.on_rank0(lambda: 42) == 42
    assert world.on_rank0(divmod, 7, 2) == (3, 1)
    assert world.gather({"a": 1}) == [{"a": 1}]
    assert world.mean({"x": 2.0}) == {"x": 2.0}
    with pytest.raises(ValueError, match="boom"):
        world.on_rank0(lambda: (_ for _ in ()).throw(ValueError("boom")))
