"""What every grouped-query-attention family megatron builds from its own file (glm4, glm4_moe, minimax_m2) reads
the same way from its HF config: the shapes, the default rope, and the checks they share (silu MLPs, no rope
scaling). Each family adds its own fields on top."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.common.errors import InvalidArgument


def gqa_fields(get: Callable[..., Any], family: str, *, partial_rotary_default: float = 1.0) -> dict[str, Any]:
    """ModelArch's shared fields of a `family` config (`get(key, default)`); what megatron-core cannot build raises
    InvalidArgument naming the field. `partial_rotary_default`: the rope share of each head when the config says
    none (GLM-4 rotates half)."""
    if get("hidden_act", "silu") != "silu":
        raise InvalidArgument(f"megatron backend: {family} hidden_act {get('hidden_act')!r} is not supported "
                              "(silu only)")
    rope = get("rope_parameters") or get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise InvalidArgument(f"megatron backend: {family} rope {rope!r} is not supported (default only)")
    heads = get("num_attention_heads")
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", partial_rotary_default))
    return dict(
        model_type=family, vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        ffn_hidden_size=get("intermediate_size"), num_layers=get("num_hidden_layers"), num_attention_heads=heads,
        num_query_groups=get("num_key_value_heads") or heads, head_dim=get("head_dim") or get("hidden_size") // heads,
        norm_epsilon=get("rms_norm_eps"), rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        rope_scaling_factor=None, max_position_embeddings=get("max_position_embeddings"),
        rotary_percent=float(partial or 1.0), tie_word_embeddings=bool(get("tie_word_embeddings", False)))
