"""The GLM-4.5 / GLM-4.7 family (`glm4_moe`, GLM-4.5-Air to GLM-4.7-355B) on megatron-core: grouped-query attention
with q/k/v bias, per-head q/k RMSNorms and RoPE on the first half of each head (Megatron's rotary_percent), dense first
layers, then DeepSeek-V3's sigmoid router (`deepseek_v3.sigmoid_moe_fields`) with a shared expert. Its weights take
convert.py's GQA and MoE maps as they are; only its ModelArch fields are its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.common.errors import InvalidArgument
from services.trainer.models.deepseek_v3 import sigmoid_moe_fields


def arch_fields(get: Callable[..., Any]) -> dict[str, Any]:
    """ModelArch's fields of a glm4_moe config (`get(key, default)`); what megatron-core cannot build raises
    InvalidArgument naming the field."""
    def refuse(problem: str) -> InvalidArgument:
        return InvalidArgument(f"megatron backend: glm4_moe {problem}")

    if get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act {get('hidden_act')!r} is not supported (silu only)")
    rope = get("rope_parameters") or get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise refuse(f"rope {rope!r} is not supported (default only)")
    heads, num_layers = get("num_attention_heads"), get("num_hidden_layers")
    moe_layers = tuple(i >= (get("first_k_dense_replace") or 0) for i in range(num_layers))
    return dict(
        model_type="glm4_moe", vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        ffn_hidden_size=get("intermediate_size"), num_layers=num_layers, num_attention_heads=heads,
        num_query_groups=get("num_key_value_heads") or heads, head_dim=get("head_dim") or get("hidden_size") // heads,
        norm_epsilon=get("rms_norm_eps"), rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        rope_scaling_factor=None, max_position_embeddings=get("max_position_embeddings"),
        rotary_percent=float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)) or 1.0),
        qkv_bias=bool(get("attention_bias", False)), qk_layernorm=bool(get("use_qk_norm", False)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)), **sigmoid_moe_fields(get, refuse, moe_layers))
