"""Context parallelism on megatron-core: each rank of a CP group runs its slice of every sequence of a micro-batch,
split as Megatron and the fsdp backend split it (`backends.context_parallel`): each sequence padded to a multiple of
2·CP and cut into 2·CP chunks, rank r holding chunks r and 2·CP-1-r. Packed rows are THD (each sequence its own,
megatron-core's RoPE taking each chunk's true positions from the padded cumulative lengths); padded rectangles are
BSHD, each row one sequence of the rectangle's padded width.

Attention across the slices is the project's own (`cp_attention.causal_attention`, in `CPAttention`), megatron-core's
local attention having none. Per-position outputs (log-probs, entropy, values) are all-gathered over the group into
the layout CP 1 has, so every CP rank computes the micro-batch's whole loss; the gather's backward sums the group's
gradients and Megatron's DDP averages over DP × CP ranks, so the step's gradient equals CP 1's.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.trainer.backends.fsdp.context_parallel import (
    CPGroup,
    CPSlice,
    all_gather,
    chunk_index,
    padded_lengths,
    split,
)
from services.trainer.backends.fsdp.cp_attention import causal_attention
from services.trainer.backends.megatron.attention import SDPAttention
from services.trainer.batching.batch import RolloutBatch


@dataclass(frozen=True)
class CPRow:
    """A micro-batch as this CP rank holds it: GPTModel's inputs, the token each local position predicts, and where
    each position of the CP-1 layout (packed [1, T] or padded [b, L]) is among the group's gathered slices."""

    inputs: dict
    targets: torch.Tensor  # [rows, T_local]
    index: torch.Tensor  # [T] or [b·L]: each CP-1 position's index in the gathered slices
    shape: tuple[int, int]  # the CP-1 layout's
    group: torch.distributed.ProcessGroup

    @property
    def local_length(self) -> int:
        return self.targets.shape[1]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's per-position outputs [rows, T_local] -> the micro-batch's in the CP-1 layout, on every rank
        of the group (differentiable: the backward sums the group's gradients)."""
        return all_gather(x.reshape(-1), self.group).index_select(0, self.index.to(x.device)).view(self.shape)


def cp_row(mb: RolloutBatch, *, packed: bool, rank: int, size: int, group, pad_token_id: int,
           pad_multiple: int = 1) -> CPRow:
    """CP rank `rank`'s slice of micro-batch `mb` and its GPTModel inputs; pad_multiple: each sequence padded to a
    multiple of 2·CP·pad_multiple (the TP size under sequence parallelism, which cuts each slice over TP)."""
    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        piece = split(mb, CPGroup(size=size, rank=rank, group=group, dp_rank=0, dp_size=1, dp_group=None),
                      pad_token_id, pad_multiple)
        cu_seqlens = torch.zeros(len(piece.padded_lengths) + 1, dtype=torch.int32, device=mb.device)
        cu_seqlens[1:] = torch.tensor(piece.padded_lengths, device=mb.device).cumsum(0)
        longest = max(piece.padded_lengths)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        inputs = {"input_ids": piece.input_ids, "position_ids": piece.position_ids, "attention_mask": None,
                  "packed_seq_params": params}
        return CPRow(inputs=inputs, targets=piece.targets, index=piece.real_index,
                     shape=(1, piece.real_index.numel()), group=group)
    rows, width = mb.tokens.shape
    wide = padded_lengths([width], size, pad_multiple)[0]
    tokens = F.pad(mb.tokens, (0, wide - width), value=pad_token_id)
    targets = F.pad(tokens[:, 1:], (0, 1), value=pad_token_id)
    positions = torch.arange(wide, device=mb.device).expand(rows, wide)
    mine = chunk_index([wide] * rows, rank, size).to(mb.device)
    local = [t.reshape(-1).index_select(0, mine).view(rows, -1) for t in (tokens, targets, positions)]
    inputs = {"input_ids": local[0], "position_ids": local[2], "attention_mask": None}
    index = natural_index((wide,) * rows, size).view(rows, wide)[:, :width].reshape(-1)
    return CPRow(inputs=inputs, targets=local[1], index=index.to(mb.device), shape=(rows, width), group=group)


@functools.lru_cache(maxsize=256)
def natural_index(lengths: tuple[int, ...], size: int) -> torch.Tensor:
    """Each position of the sequences padded and packed back to back, as an index into the CP ranks' slices
    concatenated in rank order."""
    gathered = torch.cat([chunk_index(list(lengths), r, size) for r in range(size)])
    natural = torch.empty_like(gathered)
    natural[gathered] = torch.arange(gathered.numel())
    return natural


class CPAttention(SDPAttention):
    """The local spec's core attention under context parallelism: causal attention across the CP group's slices
    (`cp_attention.causal_attention`: keys and values all-gathered), packed (THD) or padded (BSHD)."""

    def __init__(self, config, *args, **kwargs) -> None:
        local = copy.copy(config)  # megatron-core's DotProductAttention refuses CP (it has no CP attention)
        local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)
        self.config = config

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        from megatron.core import parallel_state

        if self._megatron_only() or attention_bias is not None:
            raise ValueError("context parallelism takes causal attention without query-key layer scaling, sliding "
                             "windows, softmax offsets or attention bias")
        group = parallel_state.get_context_parallel_group()
        size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        dropout = self.attention_dropout.p if self.training else 0.0
        if packed_seq_params is not None:  # [t, heads, head_dim]
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            lengths = tuple((cu[1:] - cu[:-1]).tolist())
            piece = _piece(lengths, rank, size, group)
            out = causal_attention(query, key, value, piece, scale=self.softmax_scale, dropout_p=dropout)
            return out.reshape(out.shape[0], -1)
        seq, batch = query.shape[:2]  # [s_local, b, heads, head_dim]: each row one sequence of s_local·CP
        q, k, v = (t.transpose(0, 1).reshape(batch * seq, *t.shape[2:]) for t in (query, key, value))
        out = causal_attention(q, k, v, _piece((seq * size,) * batch, rank, size, group), scale=self.softmax_scale,
                               dropout_p=dropout)
        return out.reshape(batch, seq, -1).transpose(0, 1).contiguous()


def _piece(lengths: tuple[int, ...], rank: int, size: int, group) -> CPSlice:
    """What `causal_attention` reads of a slice: the padded sequences' lengths and where each position was gathered
    from (the tokens themselves are the model's business)."""
    empty = torch.zeros(0, dtype=torch.long)
    return CPSlice(input_ids=empty, position_ids=empty, targets=empty, padded_lengths=list(lengths),
                   natural_index=natural_index(lengths, size), real_index=empty, group=group, rank=rank, size=size)
