"""Causal attention across a context-parallel group's slices (`context_parallel.CPSlice`): each rank all-gathers
the keys and values of the whole packed row (the gather's backward sums the group's gradients) and attends its own
queries to them under the causal mask of each query's sequence, read from the tokens' true positions. On CPU one
scaled_dot_product_attention per sequence (no work on pairs of positions in different sequences); on CUDA one over
the row under a mask of the sequences' blocks. Padding (each sequence's tail up to a multiple of 2·CP) comes after
every real token of its sequence, so no real token attends to it. A model switched to it (`use_in`) runs on CP
slices only, and HF builds no mask for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.common.errors import InvalidArgument
from services.trainer.backends.context_parallel import CPSlice, all_gather


def _padded_row(piece: CPSlice, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) [T_padded] of every position of the padded row."""
    padded = torch.tensor(piece.padded_lengths, device=device)
    sequence = torch.repeat_interleave(torch.arange(padded.numel(), device=device), padded)
    starts = torch.cumsum(padded, 0) - padded
    return sequence, torch.arange(sequence.numel(), device=device) - starts[sequence]


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, piece: CPSlice, *,
                     scale: float | None = None, dropout_p: float = 0.0,
                     per_sequence: bool | None = None) -> torch.Tensor:
    """[T_local, heads, head_dim] query, [T_local, groups, head_dim] key and value of this rank's slice ->
    [T_local, heads, head_dim]. per_sequence None: on CPU."""
    head_dim = key.shape[-1]
    whole = all_gather(torch.cat([key, value], dim=-1), piece.group)  # one collective for both
    whole = whole.index_select(0, piece.natural_index.to(whole.device))  # the padded row, in order
    key, value = whole[..., :head_dim], whole[..., head_dim:]
    gqa = key.shape[1] != query.shape[1]
    q_pos = piece.position_ids[0].to(query.device)
    if per_sequence is None:
        per_sequence = not query.is_cuda
    if not per_sequence:  # one kernel over the row
        sequence, position = _padded_row(piece, query.device)
        mask = (piece.sequence.to(query.device).unsqueeze(1) == sequence.unsqueeze(0)) & \
            (position.unsqueeze(0) <= q_pos.unsqueeze(1))
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)[0].transpose(0, 1)
    local = [n // piece.size for n in piece.padded_lengths]
    outputs = []
    for q, pos, k, v in zip(query.split(local), q_pos.split(local), key.split(piece.padded_lengths),
                            value.split(piece.padded_lengths), strict=True):
        mask = torch.arange(k.shape[0], device=q.device).unsqueeze(0) <= pos.unsqueeze(1)  # [q, keys of the sequence]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                                      enable_gqa=gqa)[0])
    return torch.cat(outputs, dim=1).transpose(0, 1)


HF_ATTENTION = "physarum_cp"  # the name the HF attention function is registered under


def hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract ([1, heads, T_local, head_dim] in, [1, T_local, heads, head_dim] out) for
    the CP slice in kwargs' cp_slice (`CPSlice.model_inputs`)."""
    piece = kwargs.get("cp_slice")
    if piece is None:
        raise InvalidArgument("context_parallel_size > 1: the model runs on context-parallel slices only")
    if kwargs.get("sliding_window") is not None:
        raise InvalidArgument("context_parallel_size > 1: sliding-window attention layers are not supported")
    out = causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), piece,
                           scale=scaling, dropout_p=dropout if module.training else 0.0)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """HF's mask of a CP slice: none (the attention builds each sequence's own from the true positions); HF's own,
    of T_local² booleans, would read the slice's positions as sequences of their own."""
    return None


def use_in(model: torch.nn.Module) -> None:
    """Switch an HF model (one that runs transformers' AttentionInterface) to `hf_attention`, with no mask."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION, hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, _no_mask)
    model.set_attn_implementation(HF_ATTENTION)
