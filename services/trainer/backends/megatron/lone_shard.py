"""A tensor-parallel group of one rank: megatron-core's linear layers and vocab-parallel embedding still pass their
input and output through its copy-to and reduce-from regions, autograd functions that return the tensor as it is
over a group of one (their all-reduce is skipped) but cost a Python forward and backward each, on any device (70 a
step of bench/trainer_throughput.py's CPU model). Over a group of one they are skipped; over more they run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def apply() -> None:
    """Wrap the two regions as megatron-core's tensor_parallel.layers calls them; idempotent."""
    from megatron.core.tensor_parallel import layers

    layers.copy_to_tensor_model_parallel_region = _identity_over_one(layers.copy_to_tensor_model_parallel_region)
    layers.reduce_from_tensor_model_parallel_region = _identity_over_one(
        layers.reduce_from_tensor_model_parallel_region)


def _identity_over_one(region: Callable) -> Callable:
    @functools.wraps(region)
    def call(input_: torch.Tensor, group=None, *args, **kwargs) -> torch.Tensor:
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        group = get_tensor_model_parallel_group_if_none(group)
        if group is not None and group.size() == 1:
            return input_
        return region(input_, group, *args, **kwargs)

    return call
