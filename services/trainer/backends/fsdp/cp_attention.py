"""Causal attention across a context-parallel group's slices (`context_parallel.CPSlice`): each rank all-gathers
the keys and values of the whole packed row (the gather's backward sums the group's gradients) and attends each of
its chunks of a sequence to that sequence's keys up to the chunk's end, under a lower-right causal mask: chunk j of
length k is query positions [j·k, (j+1)·k), which see keys [0, (j+1)·k) with the last k causally. On CUDA no mask
is materialized where torch's causal bias runs flash or memory-efficient attention, and no work is spent on pairs
of positions in different sequences. Padding (each sequence's tail up to a multiple of 2·CP) comes after every real
token of its sequence, so no real token attends to it. A model switched to it (`use_in`) runs on CP slices only, and
HF builds no mask for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from services.common.errors import InvalidArgument
from services.trainer.backends.fsdp.context_parallel import CPSlice, all_gather


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, piece: CPSlice, *,
                     scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """[T_local, heads, head_dim] query, [T_local, groups, head_dim] key and value of this rank's slice ->
    [T_local, heads, head_dim]."""
    head_dim = key.shape[-1]
    whole = all_gather(torch.cat([key, value], dim=-1), piece.group)  # one collective for both
    whole = whole.index_select(0, piece.natural_index.to(whole.device))  # the padded row, in order
    key, value = whole[..., :head_dim], whole[..., head_dim:]
    if query.is_cuda and key.shape[1] != query.shape[1]:  # the lower-right causal kernels take no grouped heads
        key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
    gqa = key.shape[1] != query.shape[1]
    outputs, local, start = [], 0, 0
    for padded in piece.padded_lengths:
        chunk = padded // (2 * piece.size)
        for j in (piece.rank, 2 * piece.size - 1 - piece.rank):
            seen = (j + 1) * chunk  # the sequence's keys up to the chunk's end
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query[local:local + chunk], key[start:start + seen],
                                                                  value[start:start + seen]))
            outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(chunk, seen),
                                                          dropout_p=dropout_p, scale=scale, enable_gqa=gqa)[0])
            local += chunk
        start += padded
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
