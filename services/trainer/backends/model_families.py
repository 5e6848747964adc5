"""Which trainer backend builds which model family (hf_checkpoint's config.json `model_type`), asked at submit so a
job whose model cannot be built is refused before any GPU is allocated, naming the family and the backend that can.

The torch backend (fsdp) and the CPU engine build any causal LM transformers implements (AutoModelForCausalLM); the
megatron backend builds what `backends/megatron/arch.py` reads. Each backend's capabilities (`capabilities.py`) name
its check here. Knows nothing of jobs or specs.
"""

from __future__ import annotations

from typing import Any

from services.common.errors import InvalidArgument


def family(hf_config: dict[str, Any]) -> str:
    """The family's name: its model_type, a multimodal checkpoint's text model by the checkpoint's name
    (qwen3_5_text is qwen3_5)."""
    return str(hf_config.get("model_type", "")).removesuffix("_text")


def language_model_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: a multimodal checkpoint's (Qwen3.5's) text_config over its own top level."""
    text = hf_config.get("text_config")
    return {**hf_config, **text} if isinstance(text, dict) else hf_config


def fsdp_problem(hf_config: dict[str, Any], **_layout: int) -> str:
    """Why the fsdp backend cannot build this model ("" when it can); its layout is data-parallel alone."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if hf_config.get("is_encoder_decoder"):
        return ("an encoder-decoder model; the fsdp backend and the CPU engine train and serve decoder-only causal "
                "LMs")
    if hf_config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return ("transformers has no causal LM of this model_type (AutoModelForCausalLM); the fsdp backend and the CPU "
                "engine train and serve decoder-only causal LMs")
    return ""


def megatron_problem(hf_config: dict[str, Any], *, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1) -> str:
    from services.trainer.backends.megatron.arch import ModelArch  # the arch module alone: no megatron-core import

    try:
        ModelArch.from_hf_config(hf_config).check_parallel(tp_size=tp_size, pp_size=pp_size, ep_size=ep_size)
    except InvalidArgument as err:
        return str(err).removeprefix("megatron backend: ")
    return ""
