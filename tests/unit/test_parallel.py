"""The trainer's ranks without a process group: a rollout's split across ranks, and the single-rank World."""

import pytest

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.parallel import World, shard_rollout


def rollout(num_samples: int) -> list[Sample]:
    return [Sample(group_index=i // 2, index=i % 2) for i in range(num_samples)]


def ids(samples: list[Sample]) -> list[tuple[int, int]]:
    return [(s.group_index, s.index) for s in samples]


def test_each_rank_gets_an_equal_run_of_whole_groups_of_every_step():
    samples = rollout(18)  # 9 groups of 2; steps of 8 samples: the last 2 samples fill no step
    shards = [shard_rollout(samples, rank=r, world_size=2, global_batch_size=8, n_samples_per_prompt=2)
              for r in range(2)]
    assert ids(shards[0]) == ids(samples[0:4] + samples[8:12])
    assert ids(shards[1]) == ids(samples[4:8] + samples[12:16])
    assert shard_rollout(samples, rank=0, world_size=1, global_batch_size=8, n_samples_per_prompt=2) == samples


def test_a_step_that_does_not_split_into_whole_groups_is_rejected():
    with pytest.raises(InvalidArgument, match=r"global_batch_size \(6\) must be a multiple of trainer ranks × "
                                              r"n_samples_per_prompt \(2 × 2\)"):
        shard_rollout(rollout(12), rank=0, world_size=2, global_batch_size=6, n_samples_per_prompt=2)


def test_the_single_rank_world_runs_rank0_work_in_place():
    world = World()
    assert not world.distributed
    assert world.broadcast({"a": 1}) == {"a": 1}
    assert world.on_rank0(lambda: 42) == 42
    assert world.mean({"x": 2.0}) == {"x": 2.0}
    with pytest.raises(ValueError, match="boom"):
        world.on_rank0(lambda: (_ for _ in ()).throw(ValueError("boom")))
