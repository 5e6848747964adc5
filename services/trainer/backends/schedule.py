"""Which samples each optimizer step and each micro-batch hold (slime's step split and micro-batch packing).

A rollout is cut into steps of global_batch_size samples (trailing samples that do not fill a step are dropped);
each step into micro-batches of micro_batch_size samples, or, with use_dynamic_batch_size, packed first-fit so
that a micro-batch holds at most max_tokens_per_gpu tokens (a longer sample sits alone). Indices only: no tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

MicroBatch = list[int]  # sample indices of one forward/backward
Step = list[MicroBatch]  # the micro-batches of one optimizer step


def first_fit(lengths: Sequence[int], indices: Sequence[int], *, max_tokens: int) -> list[MicroBatch]:
    """Pack `indices` in order into bins of at most max_tokens tokens: each goes to the first bin it fits in."""
    bins: list[MicroBatch] = []
    loads: list[int] = []
    for i in indices:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def step_schedule(lengths: Sequence[int], *, global_batch_size: int | None, micro_batch_size: int = 1,
                  max_tokens_per_gpu: int | None = None) -> list[Step]:
    """Micro-batches (lists of sample indices) per optimizer step for samples of token counts `lengths`.

    Steps take global_batch_size consecutive samples (None: one step of all). max_tokens_per_gpu (dynamic batch
    size) packs each step first-fit by token count; otherwise steps are cut into micro_batch_size chunks.
    """
    num = len(lengths)
    step_size = global_batch_size or num
    steps: list[Step] = []
    for start in range(0, num - step_size + 1 if step_size else 0, max(step_size, 1)):
        indices = list(range(start, start + step_size))
        if max_tokens_per_gpu is not None:
            steps.append(first_fit(lengths, indices, max_tokens=max_tokens_per_gpu))
        else:
            steps.append([indices[b:b + micro_batch_size] for b in range(0, step_size, micro_batch_size)])
    return steps
