"""A micro-batch as one packed row (slime's THD layout): its sequences back to back with no padding, position ids
restarting at 0 on each, their cumulative lengths for varlen attention, and where each response token's logits sit.

Attention must not cross sequences: an HF model gets the position ids and the cumulative lengths, by which its
attention function keeps the sequences apart (`varlen`), and Megatron the cumulative lengths (packed_seq_params). The
losses never see the layout: `response_index` maps either layout's per-position outputs to the response-aligned
[b, R] tensors.

A micro-batch is packed only where that saves enough tokens (`worth_packing`): on a GPU, batches of equal lengths
trained 13 % (fsdp) and 19 % (megatron) slower packed than as the rectangle, which then holds no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.batching.batch import RolloutBatch

# Pack when the padded rectangle holds more than this share of the micro-batch's real tokens as padding.
MIN_PADDING_TO_PACK = 0.25


def worth_packing(mb: RolloutBatch, min_padding: float = MIN_PADDING_TO_PACK) -> bool:
    """Whether the micro-batch's padded rectangle (b × L) exceeds its real tokens (Σ L_i) by more than min_padding
    of them: packing's own costs (one long row, varlen bookkeeping) lose to a rectangle with little padding."""
    return mb.size * mb.tokens.shape[1] > (1 + min_padding) * sum(mb.total_lengths)


@dataclass(frozen=True)
class PackedRow:
    input_ids: torch.Tensor  # [1, T] int64, T = Σ L_i: sequence i at [cu_seqlens[i], cu_seqlens[i + 1])
    position_ids: torch.Tensor  # [1, T] int64, 0 .. L_i - 1 within each sequence
    cu_seqlens: torch.Tensor  # [b + 1] int32, the cumulative sequence lengths, starting at 0
    max_seqlen: int  # the longest L_i

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack(mb: RolloutBatch) -> PackedRow:
    """The micro-batch's real tokens in one row, on the micro-batch's device (right padding is dropped)."""
    mask = mb.attention_mask.bool()
    lengths = mask.sum(dim=-1)
    positions = torch.arange(mb.tokens.shape[1], device=mb.device).expand_as(mb.tokens)
    cu_seqlens = torch.zeros(mb.size + 1, dtype=torch.int32, device=mb.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    return PackedRow(input_ids=mb.tokens[mask].unsqueeze(0), position_ids=positions[mask].unsqueeze(0),
                     cu_seqlens=cu_seqlens, max_seqlen=mb.tokens.shape[1])


def is_packed(x: torch.Tensor, mb: RolloutBatch) -> bool:
    """Whether per-position outputs x are packed [1, T, ...] rather than padded [b, L, ...] (for a single sample
    without padding the two are the same)."""
    return tuple(x.shape[:2]) != tuple(mb.tokens.shape)


def response_index(mb: RolloutBatch, *, packed: bool) -> torch.Tensor:
    """[b, R] int64: the index, in the layout's outputs flattened over (row, position), of the logits that predict
    each response token (clamped within the sequence's row on padding columns, which the loss masks)."""
    positions = mb.logit_positions()
    if packed:
        lengths = (mb.prompt_lengths + mb.response_lengths).unsqueeze(-1)
        ends = lengths.cumsum(0)
        return ends - lengths + torch.minimum(positions, lengths - 1)
    rows = torch.arange(mb.size, device=positions.device).unsqueeze(-1)
    return rows * mb.tokens.shape[1] + positions


def response_valid(mb: RolloutBatch) -> torch.Tensor:
    """[b, R] bool: the columns that hold a response token (the others pad shorter responses)."""
    columns = torch.arange(mb.loss_masks.shape[1], device=mb.response_lengths.device)
    return columns < mb.response_lengths.unsqueeze(-1)


def response_mask(mb: RolloutBatch, *, packed: bool) -> torch.Tensor:
    """[b, L] padded or [1, T] packed bool: the positions whose logits predict a response token, as transformers'
    `logits_to_keep` takes a mask. The model then projects those positions alone onto the vocabulary (no prompt's,
    no padding's) and returns their logits as rows [N, V], N = Σ R_i, in the order of `response_valid`'s True
    entries (`scatter_response` puts them back)."""
    index = response_index(mb, packed=packed)[response_valid(mb)]
    shape = (1, sum(mb.total_lengths)) if packed else tuple(mb.tokens.shape)
    mask = torch.zeros(shape[0] * shape[1], dtype=torch.bool, device=index.device)
    return mask.index_fill_(0, index, True).view(shape)


def scatter_response(rows: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
    """Per-response-token values [N, ...] (in `response_mask`'s order) -> response-aligned [b, R, ...], zero on
    the padding columns."""
    valid = response_valid(mb).to(rows.device)
    return rows.new_zeros(*valid.shape, *rows.shape[1:]).index_put(valid.nonzero(as_tuple=True), rows)


def gather_response(x: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
    """Per-position outputs, padded [b, L, ...] or packed [1, T, ...] -> response-aligned [b, R, ...].

    An index_select over the flattened positions: its backward is an index_add into the logits' gradient, not
    advanced indexing's serial index_put over the whole [.., V] logits."""
    index = response_index(mb, packed=is_packed(x, mb)).to(x.device)
    return x.flatten(0, 1).index_select(0, index.flatten()).view(*index.shape, *x.shape[2:])
