"""Context parallelism for the fsdp backend: the ranks of a context-parallel (CP) group share their data-parallel
share of each step, and each holds a slice of every sequence of a micro-batch, load-balanced as Megatron does:
each sequence is padded to a multiple of 2·CP and cut into 2·CP equal chunks, rank r taking chunks r and 2·CP-1-r
(under causal attention the early chunks are cheap and the late ones dear: each rank gets one of each).

The model runs on the rank's slice with each token's true position (rotary) and attends across the slices
(`cp_attention`). Per-token outputs (log-probs, entropy, values) are all-gathered into the packed row's order
(`packing.pack`), so every rank of a group computes the whole micro-batch's loss from the same [b, R] tensors as
without CP. The all-gather's backward sums the group's gradients: each rank's gradient is CP times its part of the
loss's, and FSDP, sharding over all DP × CP ranks, averages over CP times as many ranks as hold distinct data, so the
step's gradient equals CP 1's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.common.errors import InvalidArgument
from services.trainer.backends.layout import CUSTOM_LOSS_REFUSAL
from services.trainer.batching.batch import RolloutBatch
from services.trainer.batching.packing import gather_response
from services.trainer.settings.train import TrainConfig


@dataclass(frozen=True)
class CPGroup:
    """This rank's context-parallel group (`size` consecutive ranks of the world) and its data-parallel peers."""

    size: int
    rank: int  # within the CP group
    group: dist.ProcessGroup | None  # the CP group; None at size 1
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup | None  # the ranks with this CP rank, one per data-parallel share; None if alone


def make_groups(rank: int, world_size: int, size: int) -> CPGroup:
    """Every rank of the world calls it (new_group is collective): CP groups of `size` consecutive ranks
    (Megatron's order under tensor parallelism 1), data-parallel groups across them."""
    if size < 1 or world_size % size:
        raise InvalidArgument(f"context_parallel_size {size} must divide the {world_size} trainer ranks")
    if size == 1:
        return CPGroup(size=1, rank=0, group=None, dp_rank=rank, dp_size=world_size, dp_group=None)
    dp_size = world_size // size
    cp_group = dp_group = None
    for first in range(0, world_size, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            cp_group = group
    for cp_rank in range(size):
        group = dist.new_group(list(range(cp_rank, world_size, size))) if dp_size > 1 else None
        if rank % size == cp_rank:
            dp_group = group
    return CPGroup(size=size, rank=rank % size, group=cp_group, dp_rank=rank // size, dp_size=dp_size,
                   dp_group=dp_group)


def padded_lengths(lengths: list[int], size: int, pad_multiple: int = 1) -> list[int]:
    """Each sequence's length rounded up to a multiple of 2·size (× pad_multiple: megatron's sequence parallelism
    cuts each rank's slice again over the tensor-parallel ranks)."""
    multiple = 2 * size * pad_multiple
    return [-(-n // multiple) * multiple for n in lengths]


def chunk_index(lengths: list[int], rank: int, size: int, pad_multiple: int = 1) -> torch.Tensor:
    """[T / size] int64: the positions, in the row of the sequences padded (`padded_lengths`) and packed back to
    back, that CP rank `rank` holds: chunks rank and 2·size-1-rank of each sequence, in order."""
    parts, offset = [], 0
    for padded in padded_lengths(lengths, size, pad_multiple):
        chunk = padded // (2 * size)
        for k in (rank, 2 * size - 1 - rank):
            parts.append(torch.arange(offset + k * chunk, offset + (k + 1) * chunk))
        offset += padded
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class _GatherCP(torch.autograd.Function):
    """All-gather along dim 0 over the CP group (rank order); the backward sums the ranks' gradients of the whole
    and hands each rank its part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            part = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
            dist.reduce_scatter_tensor(part, grad, group=ctx.group)
            return part, None
        grad = grad.clone()  # gloo has no reduce-scatter: sum the whole, keep this rank's part
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(size)[rank], None


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[n, ...] on each CP rank -> [size·n, ...] in rank order, differentiable (the backward sums over the group)."""
    return _GatherCP.apply(x, group)


@dataclass(frozen=True)
class CPSlice:
    """A micro-batch's packed row as one CP rank holds it, and the maps back to the whole row. "Padded" positions
    index the row of the sequences padded to multiples of 2·CP; "gathered" positions index the ranks' slices
    concatenated in rank order (what `all_gather` returns)."""

    input_ids: torch.Tensor  # [1, T_local] this rank's tokens (pad id on padding)
    position_ids: torch.Tensor  # [1, T_local] each token's position in its sequence
    targets: torch.Tensor  # [1, T_local] the token each position predicts (the next one of its sequence, or pad)
    padded_lengths: list[int]  # per sequence
    natural_index: torch.Tensor  # [T_padded]: each padded position's gathered position
    real_index: torch.Tensor  # [T]: each packed real token's gathered position, in `packing.pack`'s order
    group: dist.ProcessGroup
    rank: int  # within the CP group
    size: int

    def model_inputs(self) -> dict[str, torch.Tensor | CPSlice]:
        """An HF model's inputs: the slice with true positions; `cp_slice` reaches the attention (`cp_attention`)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "cp_slice": self}

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Per-position outputs of the slice [1, T_local, ...] -> the packed row's [1, T, ...] on every rank."""
        whole = all_gather(x[0], self.group)
        return whole.index_select(0, self.real_index.to(whole.device)).unsqueeze(0)


def split(mb: RolloutBatch, cp: CPGroup, pad_token_id: int, pad_multiple: int = 1) -> CPSlice:
    """CP rank cp.rank's slice of micro-batch `mb` packed into one row (as `packing.pack`, then padded per
    sequence, to a multiple of 2·CP·pad_multiple, and cut into chunks)."""
    device = mb.device
    lengths_t = mb.attention_mask.sum(dim=-1)
    lengths = lengths_t.tolist()
    padded = padded_lengths(lengths, cp.size, pad_multiple)
    padded_t = torch.tensor(padded, device=device)
    sequence = torch.repeat_interleave(torch.arange(len(padded), device=device), padded_t)
    starts = torch.cumsum(padded_t, 0) - padded_t
    position = torch.arange(sequence.numel(), device=device) - starts[sequence]
    seq_len = lengths_t[sequence]
    last = mb.tokens.shape[1] - 1
    tokens = torch.where(position < seq_len, mb.tokens[sequence, position.clamp(max=last)], pad_token_id)
    targets = torch.where(position + 1 < seq_len, mb.tokens[sequence, (position + 1).clamp(max=last)],
                          pad_token_id)
    mine = chunk_index(lengths, cp.rank, cp.size, pad_multiple).to(device)
    gathered = torch.cat([chunk_index(lengths, r, cp.size, pad_multiple) for r in range(cp.size)]).to(device)
    natural = torch.empty_like(gathered)
    natural[gathered] = torch.arange(gathered.numel(), device=device)
    real = (position < seq_len).nonzero().squeeze(-1)
    return CPSlice(input_ids=tokens[mine].unsqueeze(0), position_ids=position[mine].unsqueeze(0),
                   targets=targets[mine].unsqueeze(0), padded_lengths=padded, natural_index=natural,
                   real_index=natural[real], group=cp.group, rank=cp.rank, size=cp.size)


def check(model: torch.nn.Module, packable: bool, config: TrainConfig) -> None:
    """CP runs the packed row's attention itself: a model whose packed sequences do not stay apart cannot; a custom
    loss takes the whole row's logits, which no rank holds."""
    if config.loss_type == "custom_loss":
        raise InvalidArgument(CUSTOM_LOSS_REFUSAL)
    if not packable:
        raise InvalidArgument(f"context_parallel_size > 1: {type(model).__name__} cannot keep packed sequences "
                              "apart (an attention that is not transformers' AttentionInterface, or layers that mix "
                              "tokens outside attention); use context_parallel_size 1")


def response_stats(model: torch.nn.Module, mb: RolloutBatch, piece: CPSlice, config: TrainConfig, *,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response-aligned (log_probs, entropy) [b, R] at the rollout temperature, each rank computing its slice's
    positions (the targets shifted on the whole sequence, before the split) and all of them gathered."""
    from services.trainer.algorithms.losses import token_log_probs_and_entropy

    logits = model(**piece.model_inputs(), use_cache=False).logits
    log_probs, entropy = token_log_probs_and_entropy(logits, piece.targets, temperature=config.rollout_temperature,
                                                     with_entropy=with_entropy,
                                                     entropy_grad=config.entropy_coef != 0)
    log_probs = gather_response(piece.gather(log_probs), mb)
    return log_probs, None if entropy is None else gather_response(piece.gather(entropy), mb)


def response_values(value_model: torch.nn.Module, mb: RolloutBatch, piece: CPSlice) -> torch.Tensor:
    """The critic's response-aligned values [b, R], gathered from the slices as `response_stats`."""
    return gather_response(piece.gather(value_model(**piece.model_inputs())), mb)
