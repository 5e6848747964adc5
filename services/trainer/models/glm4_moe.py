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
from services.trainer.models.gqa import gqa_fields


def arch_fields(get: Callable[..., Any]) -> dict[str, Any]:
    """ModelArch's fields of a glm4_moe config (`get(key, default)`); what megatron-core cannot build raises
    InvalidArgument naming the field."""
    def refuse(problem: str) -> InvalidArgument:
        return InvalidArgument(f"megatron backend: glm4_moe {problem}")

    fields = gqa_fields(get, "glm4_moe")
    moe_layers = tuple(i >= (get("first_k_dense_replace") or 0) for i in range(fields["num_layers"]))
    return dict(fields, qkv_bias=bool(get("attention_bias", False)), qk_layernorm=bool(get("use_qk_norm", False)),
                **sigmoid_moe_fields(get, refuse, moe_layers))
