"""The distributed optimizer's bucket collectives (megatron-core's param_and_grad_buffer) skip an in-place call over a
group of one rank and run every other: a copy over a group of one, the exchange over two ranks (2 gloo processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import profile

from testkit import gloo_ranks


def _collectives_run(call) -> int:
    """How many c10d collectives `call` ran."""
    with profile() as prof:
        call()
    return sum(event.name.startswith("c10d::") for event in prof.events())


def _rank(rank: int, world: int) -> dict:
    from megatron.core.distributed import param_and_grad_buffer as buffers

    from services.trainer.backends.megatron import lone_replica

    lone_replica.apply()
    lone_replica.apply()  # idempotent: one wrapper
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank takes part in each new_group
    out = {}
    # over a group of one, in place (each rank's shard is the whole buffer): skipped, the buffer as it was
    params = torch.arange(4.0) + 10 * rank
    out["alone_gather"] = _collectives_run(
        lambda: buffers.dist_all_gather_func(params, params[:], group=alone, async_op=False))
    out["alone_params"] = params.clone()
    grads = torch.arange(4.0) + 10 * rank
    out["alone_scatter"] = _collectives_run(
        lambda: buffers.dist_reduce_scatter_func(grads[:], grads, group=alone, async_op=False))
    out["alone_grads"] = grads.clone()
    # over a group of one, not in place: the collective runs (a copy)
    target = torch.zeros(4)
    out["alone_copies"] = _collectives_run(
        lambda: buffers.dist_all_gather_func(target, params, group=alone, async_op=False))
    out["alone_copy"] = target
    # over both ranks, in place: the all-gather fills the other rank's shard, the reduce-scatter sums into this one's
    shared = torch.full((4,), -1.0)
    shared[2 * rank:2 * rank + 2] = torch.tensor([1.0, 2.0]) + 10 * rank
    buffers.dist_all_gather_func(shared, shared[2 * rank:2 * rank + 2], group=dist.group.WORLD, async_op=False)
    out["both_gather"] = shared
    summed = torch.arange(4.0) + 10 * rank
    buffers.dist_reduce_scatter_func(summed[2 * rank:2 * rank + 2], summed, group=dist.group.WORLD, async_op=False)
    out["both_scatter"] = summed[2 * rank:2 * rank + 2].clone()
    return out


def test_in_place_collectives_over_one_rank_are_skipped_and_the_others_run():
    ranks = gloo_ranks.run(_rank)
    for rank, got in enumerate(ranks):
        mine = torch.arange(4.0) + 10 * rank
        assert got["alone_gather"] == got["alone_scatter"] == 0 and got["alone_copies"] >= 1
        assert torch.equal(got["alone_params"], mine) and torch.equal(got["alone_grads"], mine)
        assert torch.equal(got["alone_copy"], mine)
        assert torch.equal(got["both_gather"], torch.tensor([1.0, 2.0, 11.0, 12.0]))
        # Σ over ranks of (arange + 10·rank) = 2·arange + 10, this rank's two entries
        assert torch.equal(got["both_scatter"], (2 * torch.arange(4.0) + 10)[2 * rank:2 * rank + 2])
