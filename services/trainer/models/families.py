"""Which trainer backend builds which model family (hf_checkpoint's config.json `model_type`), asked at submit so a
job whose model cannot be built is refused before any GPU is allocated, naming the family and the backend that can.

The torch backend (fsdp) and the CPU engine build any causal LM transformers implements (AutoModelForCausalLM); the
megatron backend builds what `models/arch.py` reads. Each backend's capabilities (`capabilities.py`) name
its check here. Knows nothing of jobs or specs.
"""

from __future__ import annotations

from typing import Any

from services.common.errors import InvalidArgument
from services.trainer.models.arch import language_model_config


def family(hf_config: dict[str, Any]) -> str:
    """The family's name: its model_type, a multimodal checkpoint's text model by the checkpoint's name
    (qwen3_5_text is qwen3_5)."""
    return str(hf_config.get("model_type", "")).removesuffix("_text")


def fsdp_problem(hf_config: dict[str, Any], **_layout: int) -> str:
    """Why the fsdp backend cannot build this model ("" when it can); its layout is data-parallel alone."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if hf_config.get("is_encoder_decoder"):
        return ("an encoder-decoder model; the fsdp backend and the CPU engine train and serve decoder-only causal "
                "LMs")
    if hf_config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not is_vision_language(hf_config):
        return ("transformers has no causal LM of this model_type (AutoModelForCausalLM); the fsdp backend and the CPU "
                "engine train and serve decoder-only causal LMs")
    return ""


def is_vision_language(hf_config: dict[str, Any], *, images: bool = False) -> bool:
    """Whether the trainer builds this checkpoint as its vision-language model (with the vision tower): a model_type
    with an image-text-to-text class and no causal LM (Qwen2.5-VL, Qwen3-VL, GLM-4V); for a job with images
    (`images`, multimodal_keys) also one whose family has a causal LM too (Qwen3.5), which a text job trains as that
    language model."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = hf_config.get("model_type")
    if "vision_config" not in hf_config or model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return False
    return images or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def megatron_problem(hf_config: dict[str, Any], *, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1,
                     etp_size: int = 1, pipeline_ends: dict[str, int | None] | None = None) -> str:
    """pipeline_ends: the first and last stages' layers when the pipeline is uneven (`uneven_stage_layers`)."""
    # the arch module alone: no megatron-core import
    from services.trainer.models.arch import ModelArch, uneven_stage_layers

    try:
        arch = ModelArch.from_hf_config(hf_config)
        stage_layers = uneven_stage_layers(arch.num_layers, pp_size, **(pipeline_ends or {}))
        arch.check_parallel(tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, etp_size=etp_size,
                            stage_layers=stage_layers)
    except InvalidArgument as err:
        return str(err).removeprefix("megatron backend: ")
    return ""


# The MoE families whose routers the fsdp backend replays, by the transformers class of their router (each returns
# logits, top-k weights, top-k indices; moe/hf_routing_replay.py replaces the indices and recomputes the weights):
# Qwen's softmax routers, GLM-4-MoE's, DeepSeek-V3's and GLM-5's sigmoid ones with an expert bias.
REPLAYABLE_ROUTERS: dict[str, str] = {"qwen3_moe": "Qwen3MoeTopKRouter", "qwen3_5_moe": "Qwen3_5MoeTopKRouter",
                                      "qwen3_next": "Qwen3NextTopKRouter", "glm4_moe": "Glm4MoeTopkRouter",
                                      "deepseek_v3": "DeepseekV3TopkRouter", "glm4_moe_lite": "Glm4MoeLiteTopkRouter",
                                      "glm_moe_dsa": "GlmMoeDsaTopkRouter"}
# The families whose models output their router logits (output_router_logits) for the load-balancing loss; the
# sigmoid ones score experts by sigmoid (moe/load_balancing.py), the others by softmax.
SIGMOID_ROUTERS = ("glm4_moe", "deepseek_v3", "glm4_moe_lite")
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen's (two spellings), DeepSeek's
AUX_LOSS_FAMILIES = ("qwen3_moe", "qwen3_5_moe", *SIGMOID_ROUTERS)
GATED_DELTA_NET_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # hybrid stacks: gated delta-nets among attention


def _family_problem(hf_config: dict[str, Any], families: tuple[str, ...] | dict[str, str]) -> str:
    if "model_type" in hf_config and family(hf_config) not in families:
        return f"model family {family(hf_config)!r} is not one it applies to ({', '.join(families)})"
    return ""


def fsdp_replay_problem(hf_config: dict[str, Any], **_layout: int) -> str:
    """Why the torch backend cannot replay this model's routing ("" when it can): it patches the routers above."""
    return _family_problem(hf_config, REPLAYABLE_ROUTERS)


def fsdp_aux_loss_problem(hf_config: dict[str, Any], **_layout: int) -> str:
    """Why the torch backend cannot add this model's load-balancing loss ("" when it can)."""
    return _family_problem(hf_config, AUX_LOSS_FAMILIES)


def megatron_replay_problem(hf_config: dict[str, Any], **_layout: int) -> str:
    """megatron-core replays any MoE it builds, in any layout: at TP > 1 every TP rank's routers replay the same
    experts, or under sequence parallelism each its slice of the tokens'."""
    return ""


def megatron_train_mode_problem(hf_config: dict[str, Any], *, tp_size: int = 1, sequence_parallel: bool = False,
                                **_layout: int) -> str:
    """Why megatron-core cannot run this model's training forwards in train mode, which its load-balancing loss and
    dropout need: its MoE layers refuse it at TP > 1 without sequence parallelism (the backend trains them there in
    eval mode)."""
    config = language_model_config(hf_config)
    moe = any(config.get(name) for name in EXPERT_COUNT_FIELDS)
    if moe and tp_size > 1 and not sequence_parallel:
        return (f"it adds it to a MoE model at tensor_model_parallel_size 1 or under megatron.sequence_parallel "
                f"(megatron-core's MoE layers train at TP > 1 only so), got tensor_model_parallel_size {tp_size}")
    return ""


def megatron_context_parallel_problem(hf_config: dict[str, Any], *, images: bool = False) -> str:
    """"" when megatron splits this model's sequences over CP ranks, else why not: the submit check's reason and the
    backend's when it builds the model. Its DeepSeek sparse attention (GLM-5) and a vision-language model's forward
    (`images`: a job with multimodal_keys, as is_vision_language takes it) take whole sequences; the rest as
    context_parallel_problem, its gated delta nets gathered."""
    if family(language_model_config(hf_config)) == "glm_moe_dsa":
        return "megatron-core's DeepSeek sparse attention (GLM-5) does not split sequences over ranks"
    if is_vision_language(hf_config, images=images):
        return "a vision-language model's forward runs each sequence whole on one rank (its multimodal positions)"
    return context_parallel_problem(hf_config, gathers_gated_delta_nets=True)


def fsdp_context_parallel_problem(hf_config: dict[str, Any], *, images: bool = False) -> str:
    """"" when fsdp splits this model's sequences over CP ranks, else why not (context_parallel_problem)."""
    return context_parallel_problem(hf_config)


def context_parallel_problem(hf_config: dict[str, Any], *, gathers_gated_delta_nets: bool = False) -> str:
    """"" when context parallelism (`backends/fsdp/context_parallel.py`) can split the model's sequences, else why not:
    its attention runs per token pair across ranks, so every layer must be full causal attention (no sliding
    window, no layer mixing tokens outside attention, such as Qwen3.5's gated delta nets) but, where the backend
    gathers a gated delta-net's sequence over the CP group (`gathers_gated_delta_nets`: megatron's), those."""
    config = language_model_config(hf_config)
    if family(config) in GATED_DELTA_NET_FAMILIES and gathers_gated_delta_nets:
        return ""
    if family(config) in GATED_DELTA_NET_FAMILIES and not config.get("layer_types"):
        return "its gated delta-net (linear_attention) layers are not full attention"  # the default hybrid stack
    other = sorted({kind for kind in config.get("layer_types") or [] if kind != "full_attention"})
    if other:
        return f"its {', '.join(other)} layers are not full attention"
    if config.get("use_sliding_window"):
        return "its attention has a sliding window"
    return ""
