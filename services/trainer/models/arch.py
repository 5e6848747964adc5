"""The architecture of an HF causal LM (Qwen2 and MiMo, Qwen3, Qwen3-MoE, Llama; DeepSeek-V3 and GLM-4.7-Flash through
`deepseek_v3.py`, GLM-5's DeepSeek sparse attention through `glm_moe_dsa.py`, GLM-4.5/4.7 through `glm4_moe.py`,
GLM-4 through `glm4.py`, Qwen3-Next and Qwen3.5 through `qwen3_next.py`) as the few numbers Megatron and the converter
need.

Reads a transformers config (or its config.json dict); knows nothing of Megatron modules or process groups.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgument

MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite", "glm_moe_dsa")  # deepseek_v3.py reads them
GATED_DELTA_NET_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # qwen3_next.py reads them
QWEN2_SHAPED = ("qwen2", "mimo")  # MiMo: Qwen2 with multi-token-prediction layers (`mtp.py`)
# vision-language checkpoints: their language model's family (megatron's), the vision tower transformers' own
VISION_LANGUAGE_TEXT_TYPES = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
SUPPORTED_MODEL_TYPES = (*QWEN2_SHAPED, "qwen3", "qwen3_moe", "llama", "glm4", "glm4_moe", "minimax_m2",
                         *MLA_MODEL_TYPES, *GATED_DELTA_NET_MODEL_TYPES, *VISION_LANGUAGE_TEXT_TYPES)
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron's default; the padded vocab is a multiple of this × TP size
# The only Llama-3 RoPE scaling Megatron's RotaryEmbedding implements (factor is free).
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def language_model_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: a multimodal checkpoint's (Qwen3.5's) text_config over its own top level."""
    text = hf_config.get("text_config")
    return {**hf_config, **text} if isinstance(text, dict) else hf_config


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention: queries through a q_lora_rank bottleneck (None: one projection), keys and values
    from a kv_lora_rank latent; each head's query/key is a nope part and a rope part (one rope key for all heads)."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class SparseAttentionShape:
    """DeepSeek sparse attention (GLM-5): each query attends only to the index_topk keys its lightning indexer
    (index_n_heads heads of index_head_dim) scores highest."""
    index_n_heads: int
    index_head_dim: int
    index_topk: int


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """Gated delta-net (linear attention) layers: a causal depthwise convolution of conv_kernel_dim taps over the
    q/k/v channels, then the gated delta rule over num_value_heads heads (each key head shared by
    num_value_heads / num_key_heads of them)."""
    conv_kernel_dim: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    norm_epsilon: float
    rope_theta: float
    rope_scaling_factor: float | None  # Llama-3 RoPE scaling, None when off
    rotary_percent: float = 1.0  # the share of each head's dimensions RoPE rotates (the first ones; GLM-4.5: half)
    rotary_interleaved: bool = False  # RoPE on (even, odd) pairs, not the two halves (GLM-4)
    post_norms: bool = False  # an RMSNorm after attention and after the MLP, before each residual add (GLM-4)
    projection_qk_norm: bool = False  # the q/k norms span the whole projection, not each head (MiniMax-M2)
    max_position_embeddings: int
    qkv_bias: bool  # Qwen2: q/k/v projections carry a bias
    qk_layernorm: bool  # Qwen3: RMSNorm of each query and key head
    tie_word_embeddings: bool
    # mixture of experts (Qwen3-MoE: every layer's MLP); 0 experts: a dense model
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_pre_softmax: bool = False  # softmax over every expert, then top-k (HF's norm_topk_prob false)
    # decoder layers of each pipeline stage when they are uneven (megatron-core's first/last stage sizes); None: even
    stage_layers: tuple[int, ...] | None = None
    moe_router_score_function: str = "softmax"  # or "sigmoid" (DeepSeek-V3, GLM-4.5/4.7)
    moe_router_expert_bias: bool = False  # a per-expert bias added to the scores that choose (not weigh) experts
    moe_router_num_groups: int | None = None  # grouped top-k: experts in groups, the best group_topk groups first
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None  # the top-k weights times this (routed_scaling_factor)
    moe_shared_expert_intermediate_size: int = 0  # an always-on MLP beside the routed experts; 0: none
    moe_layers: tuple[bool, ...] | None = None  # which layers are MoE (None: every layer, when there are experts)
    mla: MLAShape | None = None  # multi-latent attention's ranks and head sizes; None: grouped-query attention
    yarn: YarnScaling | None = None  # YaRN rotary scaling (MLA families)
    dsa: SparseAttentionShape | None = None  # DeepSeek sparse attention over the MLA (GLM-5); None: dense attention
    vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY  # Megatron-LM's --make-vocab-size-divisible-by
    # hybrid stacks (Qwen3-Next, Qwen3.5): which layers are gated delta-nets instead of attention, and their shape
    linear_attention: GatedDeltaNetShape | None = None
    linear_layers: tuple[bool, ...] | None = None
    attention_output_gate: bool = False  # attention's output times sigmoid of a per-head gate from the q projection
    zero_centered_norms: bool = False  # RMSNorms scale by 1 + weight (Qwen3-Next's and Qwen3.5's, but the gated one)
    moe_shared_expert_gate: bool = False  # the shared expert's output times sigmoid of a [1, hidden] gate
    # multi-token-prediction layers built after the decoder (the job's mtp_num_layers; the checkpoint's: `mtp.py`)
    mtp_num_layers: int = 0
    # a vision-language checkpoint (its model_type, e.g. qwen2_5_vl; None: a language model alone): multimodal
    # rotary positions, each head's rotary half split over (time, height, width) as mrope_section says, the three
    # bands one after another or interleaved (Qwen3-VL)
    vision_model_type: str | None = None
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    def is_linear_layer(self, index: int) -> bool:
        """Whether global layer `index` is a gated delta-net."""
        return self.linear_layers is not None and self.linear_layers[index]

    def is_moe_layer(self, index: int) -> bool:
        """Whether global layer `index` has routed experts."""
        return bool(self.num_experts) and (self.moe_layers is None or self.moe_layers[index])

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def padded_vocab_size(self, tp_size: int) -> int:
        """Megatron's padded vocab: the next multiple of vocab_size_divisible_by·tp_size (128 unless a job says; the
        extra rows are zero and never sampled)."""
        multiple = self.vocab_size_divisible_by * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple

    def stage_layer_range(self, pp_rank: int, pp_size: int) -> range:
        """The global indices of the decoder layers pipeline stage `pp_rank` holds."""
        counts = self.stage_layers or (self.num_layers // pp_size,) * pp_size
        start = sum(counts[:pp_rank])
        return range(start, start + counts[pp_rank])

    def check_parallel(self, *, tp_size: int, pp_size: int, ep_size: int = 1, etp_size: int = 1,
                       stage_layers: tuple[int, ...] | None = None) -> None:
        """Raise InvalidArgument when this model cannot be cut into tp_size × pp_size shards with its experts over
        ep_size ranks, each cut over etp_size ranks (1, or the TP size; `stage_layers`: each stage's layers, when they
        are uneven)."""
        if ep_size > 1 and (not self.num_experts or self.num_experts % ep_size):
            raise InvalidArgument(f"expert_model_parallel_size {ep_size} must divide the number of experts "
                                  f"({self.num_experts} in {self.model_type})")
        if etp_size > 1 and (not self.num_experts or etp_size != tp_size or self.moe_ffn_hidden_size % etp_size):
            raise InvalidArgument(f"expert_tensor_parallel_size {etp_size}: the megatron backend cuts each expert "
                                  "over the tensor-parallel ranks (expert_tensor_parallel_size = "
                                  "tensor_model_parallel_size, dividing the experts' intermediate size), or keeps it "
                                  "whole (1)")
        sizes = [("num_attention_heads", self.num_attention_heads), ("num_key_value_heads", self.num_query_groups),
                 ("intermediate_size", self.ffn_hidden_size)]
        if self.moe_shared_expert_intermediate_size:
            sizes.append(("the shared experts' intermediate size", self.moe_shared_expert_intermediate_size))
        if self.linear_attention:  # the gated delta-nets' heads are cut over TP as attention's are
            sizes += [("linear_num_key_heads", self.linear_attention.num_key_heads),
                      ("linear_num_value_heads", self.linear_attention.num_value_heads)]
        if self.mla:  # megatron-core builds the down-projections column-parallel (the kv one is then made whole)
            sizes.append(("kv_lora_rank + qk_rope_head_dim", self.mla.kv_lora_rank + self.mla.qk_rope_head_dim))
            if self.mla.q_lora_rank:
                sizes.append(("q_lora_rank", self.mla.q_lora_rank))
        for name, value in sizes:
            if value % tp_size:
                raise InvalidArgument(f"tensor_model_parallel_size {tp_size} must divide {name} {value}")
        if stage_layers is not None:
            if len(stage_layers) != pp_size or sum(stage_layers) != self.num_layers or min(stage_layers) < 1:
                raise InvalidArgument(f"pipeline stages of {list(stage_layers)} layers: {pp_size} stages of at least "
                                      f"one layer must hold the model's num_hidden_layers {self.num_layers}")
        elif self.num_layers % pp_size:
            raise InvalidArgument(f"pipeline_model_parallel_size {pp_size} must divide num_hidden_layers "
                                  f"{self.num_layers}")

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        """From a transformers PretrainedConfig or a config.json dict; unsupported variants raise InvalidArgument."""
        whole = config if isinstance(config, dict) else config.to_dict() if hasattr(config, "to_dict") else {}
        if whole.get("model_type") in VISION_LANGUAGE_TEXT_TYPES:
            return cls._vision_language(whole)
        if isinstance(config, dict):
            config = language_model_config(config)  # a multimodal checkpoint's (Qwen3.5's) language model
        elif hasattr(config, "get_text_config"):
            config = config.get_text_config()
        get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        model_type = str(get("model_type")).removesuffix("_text")  # Qwen3.5's text config: qwen3_5_text
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgument(f"megatron backend: model_type {model_type!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if model_type in MLA_MODEL_TYPES:
            from services.trainer.models import deepseek_v3, glm_moe_dsa

            if model_type == "glm_moe_dsa":  # its defaults and derived per-layer lists, as transformers reads them
                get = glm_moe_dsa.config_reader(config)

            fields = deepseek_v3.arch_fields(get)
            yarn, dsa = fields.pop("yarn"), fields.pop("dsa", None)
            return cls(**fields | {"mla": MLAShape(**fields["mla"]), "yarn": YarnScaling(**yarn) if yarn else None,
                                   "dsa": SparseAttentionShape(**dsa) if dsa else None})
        if model_type in GATED_DELTA_NET_MODEL_TYPES:
            from services.trainer.models import qwen3_next

            fields = qwen3_next.arch_fields(get, model_type)
            return cls(**fields | {"linear_attention": GatedDeltaNetShape(**fields["linear_attention"])})
        if model_type == "minimax_m2":
            from services.trainer.models import minimax_m2

            return cls(**minimax_m2.arch_fields(get))
        if model_type == "glm4":
            from services.trainer.models import glm4

            return cls(**glm4.arch_fields(get))
        if model_type == "glm4_moe":
            from services.trainer.models import glm4_moe

            return cls(**glm4_moe.arch_fields(get))
        if get("hidden_act", "silu") != "silu":
            raise InvalidArgument(f"megatron backend: hidden_act {get('hidden_act')!r} is not supported (silu only)")
        if get("use_sliding_window", False):
            raise InvalidArgument("megatron backend: use_sliding_window is not supported")
        if model_type not in QWEN2_SHAPED and get("attention_bias", False):
            raise InvalidArgument(f"megatron backend: attention_bias is not supported for {model_type}")
        if get("mlp_bias", False):
            raise InvalidArgument("megatron backend: mlp_bias is not supported")
        num_experts = get("num_experts") or get("num_local_experts") or 0
        if num_experts and (get("decoder_sparse_step", 1) != 1 or get("mlp_only_layers")):
            raise InvalidArgument("megatron backend: dense layers among MoE layers (decoder_sparse_step, "
                                  "mlp_only_layers) are not supported")
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        head_dim = get("head_dim") or hidden // heads
        rope = get("rope_parameters") or get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_theta = rope.get("rope_theta", get("rope_theta", 10000.0))
        scaling_factor = None
        if rope_type == "llama3" and all(float(rope.get(k, v)) == v for k, v in LLAMA3_ROPE_DEFAULTS.items()):
            scaling_factor = float(rope["factor"])
        elif rope_type != "default":
            raise InvalidArgument(f"megatron backend: rope {rope!r} is not supported (default, or llama3 with "
                                  f"{LLAMA3_ROPE_DEFAULTS})")
        return cls(model_type=model_type, vocab_size=get("vocab_size"), hidden_size=hidden,
                   ffn_hidden_size=get("intermediate_size"), num_layers=get("num_hidden_layers"),
                   num_attention_heads=heads, num_query_groups=get("num_key_value_heads") or heads,
                   head_dim=head_dim, norm_epsilon=get("rms_norm_eps"), rope_theta=float(rope_theta),
                   rope_scaling_factor=scaling_factor, max_position_embeddings=get("max_position_embeddings"),
                   qkv_bias=model_type in QWEN2_SHAPED, qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
                   tie_word_embeddings=bool(get("tie_word_embeddings", False)), num_experts=num_experts,
                   moe_router_topk=get("num_experts_per_tok") or 0 if num_experts else 0,
                   moe_ffn_hidden_size=get("moe_intermediate_size") or 0 if num_experts else 0,
                   moe_router_pre_softmax=bool(num_experts) and not get("norm_topk_prob", False))

    @classmethod
    def _vision_language(cls, config: dict[str, Any]) -> ModelArch:
        """A vision-language checkpoint's language model (its text_config as its text family's) with its
        multimodal rotary layout."""
        model_type = config["model_type"]
        own = {key: value for key, value in (config.get("text_config") or {}).items() if value is not None}
        text = {**{key: value for key, value in config.items() if key != "text_config"}, **own,
                "model_type": VISION_LANGUAGE_TEXT_TYPES[model_type]}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        plain = {key: value for key, value in rope.items() if key not in ("mrope_section", "mrope_interleaved", "type")}
        return cls.from_hf_config({**text, "rope_parameters": plain, "rope_scaling": None}).with_vision(config)

    def with_vision(self, hf_config: dict[str, Any]) -> ModelArch:
        """This language model as the one of vision-language checkpoint `hf_config` (Qwen2.5-VL, Qwen3-VL, or for
        a job with images Qwen3.5): its multimodal rotary layout, from its text config's rope parameters."""
        text = hf_config.get("text_config") or hf_config
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        section = rope.get("mrope_section")
        model_type = hf_config.get("model_type")
        if not section:
            raise InvalidArgument(f"megatron backend: {model_type} without mrope_section in its rope parameters")
        if 2 * sum(section) != self.rotary_dim:
            raise InvalidArgument(f"megatron backend: mrope_section {section} does not split the rotary half "
                                  f"({self.rotary_dim // 2} of each head's dimensions)")
        return dataclasses.replace(self, vision_model_type=model_type, mrope_section=tuple(section),
                                   mrope_interleaved=bool(rope.get("mrope_interleaved")))

    @property
    def rotary_dim(self) -> int:
        """Each head's dimensions RoPE turns (the first ones)."""
        return int(self.head_dim * self.rotary_percent)


def uneven_stage_layers(num_layers: int, pp_size: int, *, first: int | None = None,
                        last: int | None = None) -> tuple[int, ...] | None:
    """Each pipeline stage's decoder layers with megatron-core's num_layers_in_first/last_pipeline_stage (slime:
    --decoder-first/last-pipeline-num-layers): the given ends, the rest split evenly over the middle stages (None
    when neither is given). Raises InvalidArgument when they do not add up."""
    if first is None and last is None:
        return None
    if pp_size < 2:
        raise InvalidArgument("uneven pipeline stages (num_layers_in_first/last_pipeline_stage) need "
                              "pipeline_model_parallel_size > 1")
    ends = [n for n in (first, last) if n is not None]
    middle = pp_size - len(ends)
    rest = num_layers - sum(ends)
    if min(ends) < 1 or rest < middle or (middle and rest % middle) or (not middle and rest):
        raise InvalidArgument(f"uneven pipeline stages: first {first}, last {last} of num_hidden_layers {num_layers} "
                              f"leave {rest} layers, which {middle} middle stages cannot split evenly")
    each = rest // middle if middle else 0
    counts = [each] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)
