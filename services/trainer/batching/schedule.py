"""Which samples each optimizer step and each micro-batch hold (slime's step split and micro-batch packing).

A rollout is cut into steps of global_batch_size samples (trailing samples that do not fill a step are dropped);
each step into micro-batches of micro_batch_size samples, or, with use_dynamic_batch_size, packed first-fit
decreasing so that a micro-batch holds at most max_tokens_per_gpu tokens (a longer sample sits alone); over
data-parallel ranks, the micro-batches are dealt so that every rank runs as many and their token sums are balanced.
Indices only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MicroBatch = list[int]  # sample indices of one forward/backward
Step = list[MicroBatch]  # the micro-batches of one optimizer step


def first_fit(lengths: Sequence[int], indices: Sequence[int], *, max_tokens: int) -> list[MicroBatch]:
    """Pack `indices` into bins of at most max_tokens tokens, first-fit decreasing: longest first, each to the first
    bin it fits in (long samples share bins with long ones, so a micro-batch's response-aligned tensors spend little
    on padding columns). Bins ordered by their first sample, each bin's samples in order."""
    bins: list[MicroBatch] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def step_schedule(lengths: Sequence[int], *, global_batch_size: int | None, micro_batch_size: int = 1,
                  max_tokens_per_gpu: int | None = None) -> list[Step]:
    """Micro-batches (lists of sample indices) per optimizer step for samples of token counts `lengths`.

    Steps take global_batch_size consecutive samples (None: one step of all). max_tokens_per_gpu (dynamic batch
    size) packs each step first-fit decreasing by token count; otherwise steps are cut into micro_batch_size chunks.
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


def _tokens(lengths: Sequence[int], rows: MicroBatch) -> int:
    return sum(lengths[i] for i in rows)


def halve(lengths: Sequence[int], rows: MicroBatch) -> tuple[MicroBatch, MicroBatch]:
    """Two non-empty halves of a micro-batch of two or more samples, token sums balanced (`balanced`); each half
    keeps the samples' order."""
    first, second = balanced([lengths[i] for i in rows], [len(rows), len(rows)])
    return sorted(rows[i] for i in first), sorted(rows[i] for i in second)


def split_to(lengths: Sequence[int], micro_batches: list[MicroBatch], count: int) -> list[MicroBatch]:
    """`count` micro-batches from `micro_batches` (count >= their number): the heaviest one that holds two or more
    samples is halved until there are enough; when none does, empty micro-batches fill the rest. Kept in order of
    their first sample, empty ones last."""
    out = [list(mb) for mb in micro_batches]
    while len(out) < count:
        splittable = [mb for mb in out if len(mb) > 1]
        if not splittable:
            out += [[] for _ in range(count - len(out))]
            break
        heaviest = max(splittable, key=lambda mb: (_tokens(lengths, mb), -mb[0]))
        out.remove(heaviest)
        out += halve(lengths, heaviest)
    return sorted(out, key=_first_row)


def balanced(weights: Sequence[int], quotas: Sequence[int]) -> list[list[int]]:
    """Items (indices into weights) into len(quotas) bins of at most quotas[b] items, sums balanced: heaviest first,
    each to the lightest bin with room (longest-processing-time first; ties to the earlier item and bin)."""
    bins: list[list[int]] = [[] for _ in quotas]
    loads = [0] * len(quotas)
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min((b for b in range(len(quotas)) if len(bins[b]) < quotas[b]), key=lambda b: (loads[b], b))
        bins[b].append(item)
        loads[b] += weights[item]
    return bins


def _first_row(mb: MicroBatch) -> float:
    return mb[0] if mb else math.inf


def assign_to_ranks(lengths: Sequence[int], micro_batches: list[MicroBatch], dp_size: int) -> list[list[MicroBatch]]:
    """Micro-batches to data-parallel ranks, as many to each (the first len % dp_size ranks one more), token sums
    balanced (`balanced`). Each rank's micro-batches keep the order of their first sample."""
    quotas = [len(micro_batches) // dp_size + (r < len(micro_batches) % dp_size) for r in range(dp_size)]
    ranks = balanced([_tokens(lengths, mb) for mb in micro_batches], quotas)
    return [sorted((micro_batches[i] for i in rank), key=_first_row) for rank in ranks]


def dp_schedule(lengths: Sequence[int], rows: Sequence[int], *, dp_size: int, micro_batch_size: int = 1,
                max_tokens_per_gpu: int | None = None) -> list[list[MicroBatch]]:
    """Each data-parallel rank's micro-batches of one step's `rows` (slime's "pack first, distribute second"), as
    many on every rank (one more on some when the step has fewer samples than that takes) with token sums balanced,
    so that no rank waits on another's long tail.

    max_tokens_per_gpu: the rows packed first-fit decreasing to the budget, their number rounded up to a multiple of
    dp_size by halving the heaviest. Otherwise: ceil(rows / micro_batch_size) micro-batches, rounded up likewise, of
    at most micro_batch_size samples each, filled longest sample first into the lightest."""
    rows = list(rows)
    if max_tokens_per_gpu is not None:
        packed = first_fit(lengths, rows, max_tokens=max_tokens_per_gpu)
        count = min(-(-len(packed) // dp_size) * dp_size, len(rows))
        micro_batches = split_to(lengths, packed, max(count, len(packed)))
    else:
        count = min(-(-len(rows) // micro_batch_size // dp_size) * dp_size, len(rows))
        bins = balanced([lengths[i] for i in rows], [micro_batch_size] * count)
        micro_batches = sorted((sorted(rows[i] for i in b) for b in bins), key=_first_row)
    return assign_to_ranks(lengths, micro_batches, dp_size)
