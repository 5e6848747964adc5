"""Multi-token-prediction (MTP) layers in HF checkpoints: how many a checkpoint carries (`num_nextn_predict_layers`)
and the HF names of each one's own tensors, per family. MiMo (Qwen2-shaped) keeps them under `model.mtp_layers.{i}`;
DeepSeek-V3 and GLM-4.5+ as decoder layers `model.layers.{num_hidden_layers + i}`. Torch-free; the conversion to
megatron-core's `mtp.layers.{i}` is `checkpoint/megatron_convert.py`'s.
"""

from __future__ import annotations

from typing import Any

# The families whose checkpoints carry MTP layers, by the naming their checkpoints use
MIMO_STYLE = ("qwen2", "mimo")  # MiMo: a Qwen2 model with model.mtp_layers.*
DEEPSEEK_STYLE = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")  # extra decoder layers with enorm/hnorm/eh_proj
FAMILIES = (*MIMO_STYLE, *DEEPSEEK_STYLE)

# megatron-core's MTP sub-names (besides transformer_layer.*) -> each style's HF sub-name under the layer's prefix
MIMO_NAMES = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
              "eh_proj.weight": "input_proj.weight", "final_layernorm.weight": "final_layernorm.weight"}
DEEPSEEK_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                  "final_layernorm.weight": "shared_head.norm.weight"}


def checkpoint_layers(hf_config: dict[str, Any] | Any) -> int:
    """The MTP layers hf_config's checkpoint carries (its num_nextn_predict_layers; 0 without)."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda key, default=None: getattr(hf_config, key,
                                                                                              default)
    return int(get("num_nextn_predict_layers", 0) or 0)


def hf_prefix(model_type: str, num_layers: int, index: int) -> str:
    """The HF name prefix of MTP layer `index` (its transformer layer's tensors are named as a decoder layer's)."""
    if model_type in MIMO_STYLE:
        return f"model.mtp_layers.{index}."
    return f"model.layers.{num_layers + index}."


def hf_names(model_type: str) -> dict[str, str]:
    """megatron-core sub-name -> HF sub-name of an MTP layer's norms and projection."""
    return MIMO_NAMES if model_type in MIMO_STYLE else DEEPSEEK_NAMES


def swaps_projection_halves(model_type: str) -> bool:
    """MiMo's input_proj takes cat(hidden, token embedding); megatron-core's eh_proj cat(embedding, hidden)."""
    return model_type in MIMO_STYLE


def problem(hf_config: dict[str, Any], mtp_num_layers: int | None) -> str:
    """Why this checkpoint cannot train `mtp_num_layers` MTP layers ("" when it can, or none are asked for)."""
    if not mtp_num_layers:
        return ""
    model_type = str(hf_config.get("model_type", ""))
    if model_type not in FAMILIES:
        return (f"mtp_num_layers {mtp_num_layers}: model family {model_type!r} carries no multi-token-prediction "
                f"layers (those that do: {', '.join(FAMILIES)})")
    have = checkpoint_layers(hf_config)
    if have < mtp_num_layers:
        return (f"mtp_num_layers {mtp_num_layers}: hf_checkpoint carries {have} multi-token-prediction layers "
                "(config.json num_nextn_predict_layers)")
    return ""
