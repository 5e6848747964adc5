"""megatron-core's copy-to and reduce-from tensor-parallel regions, as its linear layers call them: over a group of one
rank the tensor itself, with no autograd node; over two ranks the regions as they were (the forward's all-reduce,
the backward's), on 2 gloo processes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from testkit import gloo_ranks


def _rank(rank: int, world: int) -> dict:
    from megatron.core.tensor_parallel import layers

    from services.trainer.backends.megatron import lone_shard

    lone_shard.apply()
    lone_shard.apply()  # idempotent: one wrapper
    assert not hasattr(layers.copy_to_tensor_model_parallel_region.__wrapped__, "__wrapped__")
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank takes part in each new_group
    out = {}
    x = (torch.arange(3.0) + 10 * rank).requires_grad_()
    h = x * 1.0
    for name in ("copy_to", "reduce_from"):
        region = getattr(layers, f"{name}_tensor_model_parallel_region")
        y = region(h, group=alone)
        out[f"alone_{name}_same"] = y is h
    # over both ranks: reduce-from sums the forward over the ranks, copy-to sums the gradient
    summed = layers.reduce_from_tensor_model_parallel_region(h * 1.0, group=dist.group.WORLD)
    out["both_reduce_from"] = summed.detach().clone()
    copied = layers.copy_to_tensor_model_parallel_region(h, group=dist.group.WORLD)
    copied.backward(torch.ones(3) * (rank + 1))
    out["both_copy_to_grad"] = x.grad.clone()
    return out


def test_regions_over_one_rank_are_the_tensor_and_over_two_reduce():
    ranks = gloo_ranks.run(_rank)
    for got in ranks:
        assert got["alone_copy_to_same"] and got["alone_reduce_from_same"]
        # Σ over ranks of (arange + 10·rank) = 2·arange + 10
        assert torch.equal(got["both_reduce_from"], 2 * torch.arange(3.0) + 10)
        # the gradients 1 and 2 of the two ranks, summed by copy-to's backward
        assert torch.equal(got["both_copy_to_grad"], torch.full((3,), 3.0))
