"""Multi-token-prediction (MTP) layers in HF checkpoints: how many a checkpoint carries (`num_nextn_predict_layers`,
Qwen3-Next's and Qwen3.5's `mtp_num_hidden_layers`) and the HF names of each one's own tensors, per family. MiMo
(Qwen2-shaped) keeps them under `model.mtp_layers.{i}`; DeepSeek-V3 and GLM-4.5+ as decoder layers
`model.layers.{num_hidden_layers + i}`; Qwen3-Next and Qwen3.5 under `mtp.layers.{i}` (a full-attention layer) with
the norms and projection they share at `mtp.*`. Torch-free; the conversion to megatron-core's `mtp.layers.{i}` is
`checkpoint/megatron_convert.py`'s.
"""

from __future__ import annotations

from typing import Any

from services.trainer.models.arch import language_model_config

# The families whose checkpoints carry MTP layers, by the naming their checkpoints use
MIMO_STYLE = ("qwen2", "mimo")  # MiMo: a Qwen2 model with model.mtp_layers.*
DEEPSEEK_STYLE = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")  # extra decoder layers with enorm/hnorm/eh_proj
QWEN_NEXT_STYLE = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # mtp.layers.* beside mtp.fc and mtp's norms
FAMILIES = (*MIMO_STYLE, *DEEPSEEK_STYLE, *QWEN_NEXT_STYLE)

# megatron-core's MTP sub-names (besides transformer_layer.*) -> each style's HF sub-name under the layer's prefix
MIMO_NAMES = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
              "eh_proj.weight": "input_proj.weight", "final_layernorm.weight": "final_layernorm.weight"}
DEEPSEEK_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                  "final_layernorm.weight": "shared_head.norm.weight"}
# Qwen3-Next's and Qwen3.5's, under mtp. (one set, for their one MTP layer; zero-centered norms as their decoder's)
QWEN_NEXT_NAMES = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
                   "eh_proj.weight": "fc.weight", "final_layernorm.weight": "norm.weight"}
QWEN_NEXT_PREFIX = "mtp."


def checkpoint_layers(hf_config: dict[str, Any] | Any) -> int:
    """The MTP layers hf_config's checkpoint carries (its num_nextn_predict_layers or mtp_num_hidden_layers, a
    multimodal checkpoint's in its text_config; 0 without)."""
    if isinstance(hf_config, dict):
        get = language_model_config(hf_config).get
    else:
        def get(key: str, default=None):
            return getattr(hf_config, key, default)
    return int(get("num_nextn_predict_layers", 0) or get("mtp_num_hidden_layers", 0) or 0)


def hf_prefix(model_type: str, num_layers: int, index: int) -> str:
    """The HF name prefix of MTP layer `index`'s transformer layer (its tensors named as a decoder layer's)."""
    if model_type in MIMO_STYLE:
        return f"model.mtp_layers.{index}."
    if model_type in QWEN_NEXT_STYLE:
        return f"{QWEN_NEXT_PREFIX}layers.{index}."
    return f"model.layers.{num_layers + index}."


def own_prefix(model_type: str, num_layers: int, index: int) -> str:
    """The HF name prefix of MTP layer `index`'s norms and projection (`hf_names`)."""
    if model_type in QWEN_NEXT_STYLE:
        if index:
            raise ValueError(f"{model_type} checkpoints name the norms and projection of one MTP layer")
        return QWEN_NEXT_PREFIX
    return hf_prefix(model_type, num_layers, index)


def hf_names(model_type: str) -> dict[str, str]:
    """megatron-core sub-name -> HF sub-name of an MTP layer's norms and projection."""
    if model_type in QWEN_NEXT_STYLE:
        return QWEN_NEXT_NAMES
    return MIMO_NAMES if model_type in MIMO_STYLE else DEEPSEEK_NAMES


def swaps_projection_halves(model_type: str) -> bool:
    """MiMo's input_proj takes cat(hidden, token embedding); megatron-core's eh_proj cat(embedding, hidden)."""
    return model_type in MIMO_STYLE


def problem(hf_config: dict[str, Any], mtp_num_layers: int | None) -> str:
    """Why this checkpoint cannot train `mtp_num_layers` MTP layers ("" when it can, or none are asked for)."""
    if not mtp_num_layers:
        return ""
    model_type = str(language_model_config(hf_config).get("model_type", "")).removesuffix("_text")
    if model_type not in FAMILIES:
        return (f"mtp_num_layers {mtp_num_layers}: model family {model_type!r} carries no multi-token-prediction "
                f"layers (those that do: {', '.join(FAMILIES)})")
    have = checkpoint_layers(hf_config)
    if have < mtp_num_layers:
        key = "mtp_num_hidden_layers" if model_type in QWEN_NEXT_STYLE else "num_nextn_predict_layers"
        return (f"mtp_num_layers {mtp_num_layers}: hf_checkpoint carries {have} multi-token-prediction layers "
                f"(config.json {key})")
    return ""
