"""Rotary embeddings over the whole head (rotary_percent 1.0, not multi-latent attention) without megatron-core's
split into a rotated part and an empty pass-through tail: it concatenates the two back, a copy of every query and key
in the forward and another in the backward (the tail's slice). The same multiplies and adds, so the same numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def apply() -> None:
    """Wrap megatron-core's rope_utils._apply_rotary_pos_emb_bshd (padded and packed rows both reach it); idempotent."""
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils._apply_rotary_pos_emb_bshd = _whole_head_first(rope_utils._apply_rotary_pos_emb_bshd,
                                                              rope_utils._rotate_half)


def _whole_head_first(partial: Callable, rotate_half: Callable) -> Callable:
    @functools.wraps(partial)
    def apply_rotary(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                     multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
        if multi_latent_attention or freqs.shape[-1] != t.shape[-1]:
            return partial(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if mscale != 1.0:  # × 1.0 changes no value
            cos, sin = cos * mscale, sin * mscale
        cos, sin = cos.to(t.dtype), sin.to(t.dtype)
        return (t * cos) + (rotate_half(t, rotary_interleaved) * sin)

    return apply_rotary
