"""Tiny configurations of the decoder-only families Physarum trains and serves, built from transformers' own config
classes (nothing from a hub): the demo's `--model-family` and the per-family tests use them.

Each builder takes the tokenizer's sizes and returns a transformers config; every family shares the demo's shape
(hidden size, layers, heads), so costs stay close: MoE about the qwen3 default's CPU time, qwen3_5 about twice it
(transformers' PyTorch fallback for gated delta-net pads each sequence to 64-token chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEFAULT_FAMILY = "qwen3"


def _common(*, vocab_size: int, eos_id: int, hidden_size: int, num_layers: int) -> dict[str, Any]:
    return {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
            "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "dtype": "float32"}


def _moe(hidden_size: int) -> dict[str, Any]:
    """4 experts, 2 routed per token, each a quarter of the dense MLP."""
    return {"moe_intermediate_size": hidden_size, "num_experts_per_tok": 2}


def qwen3(**common: Any):
    from transformers import Qwen3Config

    h = common["hidden_size"]
    return Qwen3Config(**common, intermediate_size=4 * h, head_dim=h // 4, tie_word_embeddings=True)


def qwen2(**common: Any):
    from transformers import Qwen2Config

    h = common["hidden_size"]  # Qwen2.5: q/k/v bias, no q/k norm; the small ones tie lm_head to the embedding
    return Qwen2Config(**common, intermediate_size=4 * h, tie_word_embeddings=True)


def llama(**common: Any):
    from transformers import LlamaConfig

    h = common["hidden_size"]
    return LlamaConfig(**common, intermediate_size=4 * h, head_dim=h // 4, tie_word_embeddings=False)


def glm4(**common: Any):
    from transformers import Glm4Config

    h = common["hidden_size"]  # GLM-4: half-rotary interleaved RoPE, q/k/v bias, post-attention/MLP norms
    return Glm4Config(**common, intermediate_size=4 * h, head_dim=h // 4, attention_bias=True,
                      partial_rotary_factor=0.5, tie_word_embeddings=False)


def qwen3_moe(**common: Any):
    from transformers import Qwen3MoeConfig

    h = common["hidden_size"]
    return Qwen3MoeConfig(**common, **_moe(h), intermediate_size=4 * h, head_dim=h // 4, num_experts=4,
                          decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)


def glm4_moe(**common: Any):
    from transformers import Glm4MoeConfig

    h = common["hidden_size"]  # the first layer dense, the rest 4 routed experts + 1 shared
    return Glm4MoeConfig(**common, **_moe(h), intermediate_size=4 * h, head_dim=h // 4, n_routed_experts=4,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                         partial_rotary_factor=0.5, use_qk_norm=True, tie_word_embeddings=False)


def deepseek_v3(**common: Any):
    from transformers import DeepseekV3Config

    h = common["hidden_size"]  # multi-head latent attention; the first layer dense, then 4 routed + 1 shared
    return DeepseekV3Config(**{**common, "num_key_value_heads": 4}, **_moe(h), intermediate_size=4 * h,
                            n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                            topk_group=1, q_lora_rank=h // 2, kv_lora_rank=h // 2, qk_rope_head_dim=8,
                            qk_nope_head_dim=8, v_head_dim=16, tie_word_embeddings=False)


def glm4_moe_lite(**common: Any):
    from transformers import Glm4MoeLiteConfig

    h, layers = common["hidden_size"], common["num_hidden_layers"]  # GLM-4.7-Flash: DeepSeek-V3's shape
    return Glm4MoeLiteConfig(**{**common, "num_key_value_heads": 4}, **_moe(h), intermediate_size=4 * h,
                             n_routed_experts=4, n_shared_experts=1,
                             mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), n_group=1, topk_group=1,
                             q_lora_rank=h // 2, kv_lora_rank=h // 2, qk_rope_head_dim=8,
                             qk_nope_head_dim=8, v_head_dim=16, tie_word_embeddings=False)


def glm_moe_dsa(**common: Any):
    from transformers import GlmMoeDsaConfig

    h, layers = common["hidden_size"], common["num_hidden_layers"]  # GLM-5: GLM-4.7-Flash's shape, sparse attention
    return GlmMoeDsaConfig(**{**common, "num_key_value_heads": 4}, **_moe(h), intermediate_size=4 * h,
                           n_routed_experts=4, n_shared_experts=1,
                           mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), n_group=1, topk_group=1,
                           q_lora_rank=h // 2, kv_lora_rank=h // 2, qk_rope_head_dim=8, qk_nope_head_dim=8,
                           v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=4,
                           indexer_types=["full"] * layers, tie_word_embeddings=False)


def minimax_m2(**common: Any):
    from transformers import MiniMaxM2Config

    h = common["hidden_size"]  # q/k norms over the whole projection, half rotary, every layer 4 sigmoid-routed experts
    return MiniMaxM2Config(**common, intermediate_size=h, head_dim=h // 4, num_local_experts=4, num_experts_per_tok=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5}, tie_word_embeddings=False)


def _linear_attention(h: int, num_layers: int) -> dict[str, Any]:
    """Qwen3.5's hybrid stack: gated delta-net (linear attention) layers, every last of four a full-attention one;
    at 2 layers one of each."""
    every = min(num_layers, 4)
    layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(num_layers)]
    return {"layer_types": layer_types, "head_dim": h // 4, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": h // 4, "linear_value_head_dim": h // 4, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4}


def qwen3_5(**common: Any):
    from transformers import Qwen3_5TextConfig

    h = common["hidden_size"]
    return Qwen3_5TextConfig(**common, **_linear_attention(h, common["num_hidden_layers"]), intermediate_size=4 * h,
                             tie_word_embeddings=True)


def qwen3_5_moe(**common: Any):
    from transformers import Qwen3_5MoeTextConfig

    h = common["hidden_size"]
    return Qwen3_5MoeTextConfig(**common, **_moe(h), **_linear_attention(h, common["num_hidden_layers"]),
                                num_experts=4, shared_expert_intermediate_size=h, tie_word_embeddings=False)


def qwen3_next(**common: Any):
    from transformers import Qwen3NextConfig

    h = common["hidden_size"]  # Qwen3.5-MoE's stack with Qwen3-Next's fused in_proj_qkvz / in_proj_ba
    return Qwen3NextConfig(**common, **_moe(h), **_linear_attention(h, common["num_hidden_layers"]),
                           intermediate_size=4 * h, num_experts=4, shared_expert_intermediate_size=h,
                           norm_topk_prob=True, tie_word_embeddings=False)


FAMILIES: dict[str, Callable[..., Any]] = {
    "qwen3": qwen3, "qwen2": qwen2, "llama": llama, "glm4": glm4, "qwen3_moe": qwen3_moe, "glm4_moe": glm4_moe,
    "deepseek_v3": deepseek_v3, "glm4_moe_lite": glm4_moe_lite, "glm_moe_dsa": glm_moe_dsa, "minimax_m2": minimax_m2,
    "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "qwen3_next": qwen3_next,
}


def tiny_config(family: str, *, vocab_size: int, eos_id: int, hidden_size: int = 128, num_layers: int = 2):
    """The transformers config of a tiny `family` model; ValueError naming the families for an unknown one."""
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[family](**_common(vocab_size=vocab_size, eos_id=eos_id, hidden_size=hidden_size,
                                      num_layers=num_layers))
