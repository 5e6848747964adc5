"""The distributed optimizer with one data-parallel replica: megatron-core still reduce-scatters every gradient bucket
and all-gathers every parameter bucket over the group of one rank, where each rank's shard is the whole bucket, in
place (on CPU, gloo copies the buckets through: 10 ms of a 0.68 s step of bench/trainer_throughput.py). Those calls
are skipped; any other collective goes through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist


@functools.cache
def apply() -> None:
    """Wrap the bucket collectives megatron-core's param_and_grad_buffer calls; idempotent."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    buffers.dist_all_gather_func = _skipping_in_place(buffers.dist_all_gather_func)
    buffers.dist_reduce_scatter_func = _skipping_in_place(buffers.dist_reduce_scatter_func)


def is_in_place_over_one(output: torch.Tensor, input_: torch.Tensor, group, async_op: bool) -> bool:
    """A synchronous all-gather or reduce-scatter over a group of one whose input is its output: nothing to do."""
    return (not async_op and dist.get_world_size(group) == 1 and output.data_ptr() == input_.data_ptr()
            and output.numel() == input_.numel() and output.dtype == input_.dtype)


def _skipping_in_place(collective: Callable) -> Callable:
    @functools.wraps(collective)
    def call(output, input_, *args, group=None, async_op=False, **kwargs):
        if is_in_place_over_one(output, input_, group, async_op):
            return None
        return collective(output, input_, *args, group=group, async_op=async_op, **kwargs)

    return call
