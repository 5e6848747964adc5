"""A sample's response as slime's context-parallel ranks hold it: the sequence of total_length tokens cut into 2·CP
chunks of ceil(total_length / 2·CP), rank r holding chunks r and 2·CP-1-r, and of the response the log-prob positions
that fall in them (slime's cp_utils layout). Slicing a whole response tensor to this rank's part, and gathering the
ranks' parts back into the whole (differentiable: the backward all-reduces the gradient over the group).

The group is megatron-core's context-parallel one (slime's `mpu`); without it (the fsdp backend, or no process
groups) the size is 1 and both are the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CPRank:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


def current() -> CPRank:
    """This process's place in megatron-core's context-parallel group (size 1 when there is none)."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return CPRank()
    if not parallel_state.model_parallel_is_initialized():
        return CPRank()
    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return CPRank()
    return CPRank(parallel_state.get_context_parallel_rank(), size, parallel_state.get_context_parallel_group())


def logit_ranges(total_length: int, response_length: int, cp: CPRank) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ranges of sequence positions [start, end) whose logits predict response tokens on this rank (slime's
    logits offsets: within [prompt_length - 1, total_length - 1); an empty one is (0, 0))."""
    prompt_length = total_length - response_length
    chunk = (total_length + 2 * cp.size - 1) // (2 * cp.size)
    ranges = []
    for index in (cp.rank, 2 * cp.size - cp.rank - 1):
        start, end = max(index * chunk, prompt_length - 1), min((index + 1) * chunk, total_length - 1)
        ranges.append((start, end) if start < end else (0, 0))
    return ranges[0], ranges[1]


def slice_response(values, total_length: int, response_length: int, cp: CPRank):
    """This rank's part of a whole response tensor (or list) [response_length, ...]: its two ranges, concatenated."""
    if len(values) != response_length:
        raise ValueError(f"a response of {len(values)} values for response_length {response_length}")
    if cp.size == 1:
        return values
    offset = total_length - response_length - 1  # the logit position of the first response token
    parts = [values[start - offset:end - offset] for start, end in logit_ranges(total_length, response_length, cp)]
    return parts[0] + parts[1] if isinstance(values, list) else torch.cat(parts, dim=0)


def gather_response(local: torch.Tensor, total_length: int, response_length: int, cp: CPRank) -> torch.Tensor:
    """The whole response [response_length, ...] from each rank's part (`slice_response`), on every rank of the
    group: each part placed at its positions, zeros elsewhere, summed over the group."""
    if cp.size == 1:
        return local
    offset = total_length - response_length - 1
    whole = local.new_zeros(response_length, *local.shape[1:])
    taken = 0
    for start, end in logit_ranges(total_length, response_length, cp):
        whole = whole.index_copy(0, torch.arange(start - offset, end - offset, device=local.device),
                                 local[taken:taken + end - start])
        taken += end - start
    if taken != local.shape[0]:
        raise ValueError(f"this context-parallel rank holds {taken} of the response's values, got {local.shape[0]}")
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(whole, group=cp.group)
