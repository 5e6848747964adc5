"""Causal attention over packed sequences ([T, heads, head_dim] and their cumulative lengths) for both backends:
torch's varlen flash attention on CUDA in half precision; on CUDA otherwise (float32) compiled flex attention under a
block mask, which skips the blocks of pairs in different sequences (one scaled_dot_product_attention under the dense
block-diagonal causal mask only with dropout, which flex attention does not take); on CPU causal
scaled_dot_product_attention per sequence, which spends no work on pairs of positions in different sequences (the
mask's row costs T² where the sequences cost Σ L_i²: five times the time on the bench's long tail), a longer sequence's
queries in tiles (`CPU_QUERY_TILE`). The HF attention function here runs it for packed rows, HF's sdpa for the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F

HF_ATTENTION = "physarum_varlen"  # the name the HF attention function is registered under
# On CPU a sequence's queries go in tiles of this many rows, each against the keys up to its own end: torch's CPU
# flash kernel computes every pair of a key block it visits (512 keys), so a sequence in one call costs its whole
# L × L square where the tiles cost about half of it (the bench's long tail: 0.68 of the square, 14 % less time).
CPU_QUERY_TILE = 64


@functools.cache
def _flash_varlen():
    """torch's varlen_attn where it takes window_size (torch 2.11 on; 2.10's took is_causal), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before varlen attention
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


@functools.cache
def _flex():
    """torch's flex_attention compiled once (dynamic shapes: one kernel for every row length), and create_block_mask;
    None where torch has no flex attention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=True), create_block_mask


def flex_applies(query: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """Whether compiled flex attention runs `query`: CUDA, no dropout."""
    return query.is_cuda and dropout_p == 0.0 and _flex() is not None


def flex_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, *,
                          scale: float | None = None) -> torch.Tensor:
    """`varlen_causal_attention` by flex attention: [1, heads, T, head_dim] in and out, under a block mask built from
    each position's sequence index, so that blocks holding no pair of one sequence are skipped."""
    flex, create_block_mask = _flex()
    num_tokens = query.shape[2]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=query.device), lengths.to(query.device),
                                       output_size=num_tokens)

    def same_sequence_causal(batch, head, q_index, kv_index):
        return (sequence[q_index] == sequence[kv_index]) & (q_index >= kv_index)

    mask = create_block_mask(same_sequence_causal, B=None, H=None, Q_LEN=num_tokens, KV_LEN=num_tokens,
                             device=query.device)
    return flex(query, key, value, block_mask=mask, scale=scale, enable_gqa=key.shape[1] != query.shape[1])


def block_causal_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T, T] bool, True where a query may attend: an earlier or the same position of its own sequence."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths,
                                       output_size=num_tokens)
    return (sequence.unsqueeze(0) == sequence.unsqueeze(1)).tril_()


def flash_applies(query: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """Whether torch's varlen flash attention runs `query`: CUDA, half precision, no dropout."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0
            and _flash_varlen() is not None)


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, *, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """[T, heads, head_dim] query, [T, groups, head_dim] key and value -> [T, heads, head_dim]: each position
    attends to the earlier positions of its own sequence, sequence i being [cu_seqlens[i], cu_seqlens[i + 1])."""
    gqa = key.shape[1] != query.shape[1]
    if flash_applies(query, dropout_p):
        flash = _flash_varlen()
        extra = {}
        if gqa and "enable_gqa" in inspect.signature(flash).parameters:
            extra["enable_gqa"] = True
        elif gqa:  # each key/value head once per query head of its group
            key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
        cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32)
        return flash(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale,
                     window_size=(-1, 0), **extra)
    if flex_applies(query, dropout_p):
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, heads, T, head_dim]
        return flex_causal_attention(q, k, v, cu_seqlens, scale=scale)[0].transpose(0, 1)
    if query.is_cuda:  # one kernel over the row
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, heads, T, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(cu_seqlens, q.shape[2]),
                                             dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return tiled_causal_attention(query, key, value, lengths, scale=scale, dropout_p=dropout_p)


# run eagerly inside a compiled layer: its loop over sequences and tiles would otherwise guard on every length and
# compile again for each new set of lengths
@torch.compiler.disable
def tiled_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], *,
                           scale: float | None = None, dropout_p: float = 0.0,
                           tile: int = CPU_QUERY_TILE) -> torch.Tensor:
    """`varlen_causal_attention` off CUDA, sequence i being the next lengths[i] rows: each sequence's queries in
    tiles of `tile` rows, the first under is_causal, the others against the keys up to their own last row under a
    bottom-right causal mask (query row r of the tile at t0 sees keys ≤ t0 + r). On CPU without dropout every tile
    runs torch's CPU flash kernel directly, forward and backward, in one autograd node (`_CpuFlashTiles`); otherwise
    each tile is a scaled_dot_product_attention that autograd records."""
    if not lengths or sum(lengths) == 0:  # no tokens
        return query.new_empty(0, query.shape[1], value.shape[-1])
    if query.device.type == "cpu" and dropout_p == 0.0:
        return _CpuFlashTiles.apply(query, key, value, lengths, scale, tile)
    return _recorded_tiles(query, key, value, lengths, scale=scale, dropout_p=dropout_p, tile=tile)


def _tiles(lengths: list[int], tile: int) -> Iterator[tuple[int, int, int]]:
    """(first row of the sequence in the packed row, tile start, tile end within the sequence) of every tile."""
    start = 0
    for length in lengths:
        for t0 in range(0, length, tile):
            yield start, t0, min(t0 + tile, length)
        start += length


def _band(longest: int, tile: int, device: torch.device) -> torch.Tensor:
    """[tile, longest + tile] bool: band[r, c] is whether query row r of the tile at t0 sees key c - longest + t0;
    each tile's mask is a slice of it (`_tile_mask`)."""
    columns, rows = (torch.arange(n, device=device) for n in (longest + tile, tile))
    return columns - longest <= rows[:, None]


def _tile_mask(band: torch.Tensor, longest: int, t0: int, t1: int) -> torch.Tensor | None:
    """The tile [t0, t1)'s mask over keys [0, t1), or None for the first tile (is_causal)."""
    return None if t0 == 0 else band[:t1 - t0, longest - t0:longest - t0 + t1]


def _recorded_tiles(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], *,
                    scale: float | None, dropout_p: float, tile: int) -> torch.Tensor:
    """The tiles as scaled_dot_product_attention calls on each sequence's [1, heads, rows, head_dim] (four
    dimensions take the fused kernels), each recorded by autograd."""
    gqa = key.shape[1] != query.shape[1]
    longest = max(lengths)
    band = _band(longest, tile, query.device)
    outputs = []
    for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True):
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L_i, head_dim]
        for _, t0, t1 in _tiles([q.shape[2]], tile):
            mask = _tile_mask(band, longest, t0, t1)
            outputs.append(F.scaled_dot_product_attention(q[:, :, t0:t1], k[:, :, :t1], v[:, :, :t1], attn_mask=mask,
                                                          is_causal=mask is None, dropout_p=dropout_p, scale=scale,
                                                          enable_gqa=gqa)[0])
    return torch.cat(outputs, dim=1).transpose(0, 1)


class _CpuFlashTiles(torch.autograd.Function):
    """The tiles through torch's CPU flash kernel and its backward, called directly: one autograd node for the whole
    packed row instead of an attention, three slices and their gradients' zero-filled copies per tile, and less time
    (`python -m bench.varlen_attention`: `recorded_over_tiles`). The kernel takes grouped key/value heads as they are.
    Each tile's output and log-sum-exp are kept for its backward; the gradients of the key and value rows add up over
    the tiles that read them."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
                scale: float | None, tile: int) -> torch.Tensor:
        longest = max(lengths)
        # the kernel adds a float mask to the scores: 0 where a query sees a key, -inf where it does not
        band = torch.zeros(tile, longest + tile, dtype=query.dtype, device=query.device).masked_fill_(
            ~_band(longest, tile, query.device), float("-inf"))
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, heads, T, head_dim] views
        out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
        out_view = out.transpose(0, 1).unsqueeze(0)
        kept = []
        for s, t0, t1 in _tiles(lengths, tile):
            mask = _tile_mask(band, longest, t0, t1)
            tile_out, logsumexp = _CPU_FLASH(q[:, :, s + t0:s + t1], k[:, :, s:s + t1], v[:, :, s:s + t1], 0.0,
                                             mask is None, attn_mask=mask, scale=scale)
            out_view[:, :, s + t0:s + t1] = tile_out
            kept += (tile_out, logsumexp)
        ctx.save_for_backward(query, key, value, band, *kept)
        ctx.lengths, ctx.longest, ctx.scale, ctx.tile = lengths, longest, scale, tile
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        query, key, value, band, *kept = ctx.saved_tensors
        q, k, v, g = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value, grad))
        grads = torch.empty_like(query), torch.zeros_like(key), torch.zeros_like(value)
        dq, dk, dv = (t.transpose(0, 1).unsqueeze(0) for t in grads)
        for index, (s, t0, t1) in enumerate(_tiles(ctx.lengths, ctx.tile)):
            mask = _tile_mask(band, ctx.longest, t0, t1)
            tile_dq, tile_dk, tile_dv = _CPU_FLASH_BACKWARD(
                g[:, :, s + t0:s + t1], q[:, :, s + t0:s + t1], k[:, :, s:s + t1], v[:, :, s:s + t1],
                kept[2 * index], kept[2 * index + 1], 0.0, mask is None, attn_mask=mask, scale=ctx.scale)
            dq[:, :, s + t0:s + t1] = tile_dq
            dk[:, :, s:s + t1] += tile_dk
            dv[:, :, s:s + t1] += tile_dv
        return *grads, None, None, None


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


_PACKED_ROW = contextvars.ContextVar("physarum_packed_row", default=False)


@contextlib.contextmanager
def packed_row(packed: bool = True) -> Iterator[None]:
    """Around an HF forward of one packed row: HF builds no causal mask for the row's full-attention layers (from the
    restarting positions it would build a [T, T] one each forward), which `hf_attention` would not read: it keeps the
    sequences apart by their cumulative lengths. A sliding window's mask is still built; its layers run HF's sdpa
    under it. packed=False (a padded forward): every mask is built."""
    token = _PACKED_ROW.set(packed)
    try:
        yield
    finally:
        _PACKED_ROW.reset(token)


def hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract ([b, heads, s, head_dim] in, [b, s, heads, head_dim] out). A packed row
    (cu_seq_lens_q and max_length_q, HF's flash-attention kwargs) takes `varlen_causal_attention`; the rest goes to
    HF's sdpa."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    # a sliding-window layer keeps HF's mask, which holds the window as well as the sequences' blocks
    if cu_seqlens is None or query.shape[0] != 1 or kwargs.get("sliding_window") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        # sdpa would attend across the row's sequences; checked eagerly (a compiled layer cannot read a ContextVar)
        if attention_mask is None and not torch.compiler.is_compiling() and _PACKED_ROW.get():
            raise RuntimeError("a packed row reached sdpa without a mask: run its forward with the cumulative "
                               "lengths (cu_seq_lens_q, max_length_q), or outside varlen.packed_row()")

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = varlen_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                  cu_seqlens, int(kwargs["max_length_q"]), scale=scaling,
                                  dropout_p=dropout if module.training else 0.0)
    return out.unsqueeze(0), None


def active(model: torch.nn.Module) -> bool:
    """Whether `model` runs `hf_attention` (an HF model that follows transformers' AttentionInterface)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == HF_ATTENTION


def packable(model: torch.nn.Module) -> bool:
    """Whether a packed row's sequences stay apart in every layer of `model`: its attention runs `hf_attention`, and
    no layer mixes tokens outside attention (Qwen3.5's gated delta nets run over the whole row: transformers refuses
    packed inputs there without flash-linear-attention's kernels)."""
    config = getattr(model, "config", None)
    layer_types = getattr(getattr(config, "text_config", None) or config, "layer_types", None) or []
    return active(model) and all(kind == "full_attention" for kind in layer_types)


def _mask(*args, local_size: int | None = None, **kwargs) -> torch.Tensor | None:
    """HF's sdpa mask, but none for a `packed_row`'s full attention."""
    if _PACKED_ROW.get() and local_size is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, local_size=local_size, **kwargs)


def use_in(model: torch.nn.Module) -> None:
    """Register `hf_attention` (with sdpa's masks, none for a `packed_row`'s full attention) and switch `model` to
    it; a model that cannot switch (HF logs why) keeps its attention, as does one with DeepSeek sparse attention
    (GLM-5), whose indexer's top-k masks the attention under eager and sdpa alone (any other implementation is handed
    the indices)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    config = getattr(model, "config", None)
    if "indexed_attention" in (getattr(getattr(config, "text_config", None) or config, "layer_types", None) or []):
        return

    AttentionInterface.register(HF_ATTENTION, hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, _mask)
    model.set_attn_implementation(HF_ATTENTION)
