"""megatron-core's copy-to and reduce-from tensor-parallel regions, as its linear layers call them: over a group of one
rank the tensor itself, with no autograd node; over two ranks the regions as they were (the forward's all-reduce,
the backward's), on 2 gloo processes."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from megatron.core.tensor_parallel import layers

    from services.trainer.backends.megatron import lone_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
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
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_regions_over_one_rank_are_the_tensor_and_over_two_reduce():
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(2, os.path.join(out, "init"), out), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    for got in ranks:
        assert got["alone_copy_to_same"] and got["alone_reduce_from_same"]
        # Σ over ranks of (arange + 10·rank) = 2·arange + 10
        assert torch.equal(got["both_reduce_from"], 2 * torch.arange(3.0) + 10)
        # the gradients 1 and 2 of the two ranks, summed by copy-to's backward
        assert torch.equal(got["both_copy_to_grad"], torch.full((3,), 3.0))
