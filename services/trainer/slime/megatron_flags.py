"""Megatron's flags that slime's launch scripts pass (slime forwards them to Megatron), and what Physarum does:

- architecture flags (scripts/models/*.sh) are checked against hf_checkpoint's config.json: accepted when they
  agree, refused naming both values when they do not (the backends build the model from the HF config);
- layout and optimizer flags become the spec's own keys (tensor_model_parallel_size, lr_decay_style, ...);
- the rest become megatron-core settings in the spec's `megatron:` section (train_backend megatron), under
  megatron-core's own field name where it differs from the flag's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.trainer.slime.flags import Flag


@dataclass(frozen=True)
class Arch:
    """An architecture flag: `expected(hf_config)` is the value the flag must have for this model (None: the
    config does not say, so any value is accepted)."""

    expected: Callable[[dict[str, Any]], Any]
    bare: bool = False


def _get(key: str, default: Any = None) -> Callable[[dict[str, Any]], Any]:
    return lambda cfg: cfg.get(key, default)


def _head_dim(cfg: dict[str, Any]) -> Any:
    if cfg.get("head_dim"):
        return cfg["head_dim"]
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return None


def _gqa(cfg: dict[str, Any]) -> Any:
    kv, heads = cfg.get("num_key_value_heads"), cfg.get("num_attention_heads")
    return None if kv is None or heads is None else kv < heads


ARCH: dict[str, Arch] = {
    "num-layers": Arch(_get("num_hidden_layers")),
    "hidden-size": Arch(_get("hidden_size")),
    "ffn-hidden-size": Arch(_get("intermediate_size")),
    "num-attention-heads": Arch(_get("num_attention_heads")),
    "num-query-groups": Arch(_get("num_key_value_heads")),
    "group-query-attention": Arch(_gqa, bare=True),
    "kv-channels": Arch(_head_dim),
    "norm-epsilon": Arch(lambda cfg: cfg.get("rms_norm_eps", cfg.get("layer_norm_eps"))),
    "rotary-base": Arch(_get("rope_theta")),
    "vocab-size": Arch(_get("vocab_size")),
    "max-position-embeddings": Arch(_get("max_position_embeddings")),
    "swiglu": Arch(lambda cfg: cfg.get("hidden_act", "silu") == "silu" if "hidden_act" in cfg else None, bare=True),
    "normalization": Arch(lambda cfg: "RMSNorm" if "rms_norm_eps" in cfg else None),
    "disable-bias-linear": Arch(lambda cfg: not cfg.get("mlp_bias", False), bare=True),
    "add-qkv-bias": Arch(lambda cfg: cfg.get("attention_bias", cfg.get("model_type") == "qwen2"), bare=True),
    "qk-layernorm": Arch(lambda cfg: cfg.get("model_type") in ("qwen3", "qwen3_moe"), bare=True),
    "untie-embeddings-and-output-weights": Arch(lambda cfg: not cfg.get("tie_word_embeddings", True), bare=True),
    "use-rotary-position-embeddings": Arch(lambda cfg: True, bare=True),
    "position-embedding-type": Arch(lambda cfg: "rope"),
    "rotary-percent": Arch(lambda cfg: float(cfg.get("partial_rotary_factor", 1.0))),
    "rotary-interleaved": Arch(lambda cfg: False, bare=True),
    "apply-layernorm-1p": Arch(lambda cfg: False, bare=True),
    "post-mlp-layernorm": Arch(lambda cfg: cfg.get("model_type") == "glm4", bare=True),
    "post-self-attn-layernorm": Arch(lambda cfg: cfg.get("model_type") == "glm4", bare=True),
    "attention-output-gate": Arch(lambda cfg: bool(cfg.get("attn_output_gate", False)), bare=True),
    "use-gated-attention": Arch(lambda cfg: bool(cfg.get("attn_output_gate", False)), bare=True),
}


def _equal(given: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(given, bool):
        return bool(given) == bool(expected)
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        try:
            return math.isclose(float(given), float(expected), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return str(given).lower() == str(expected).lower()


def check_arch(flag: str, value: Any, hf_config: dict[str, Any] | None) -> str:
    """"" when the architecture flag agrees with the HF config (or the config does not say); else why not."""
    if hf_config is None:
        return f"--{flag}: cannot be checked: hf_checkpoint has no readable config.json"
    expected = ARCH[flag].expected(hf_config)
    if expected is None or _equal(value, expected):
        return ""
    return (f"--{flag} {value} disagrees with hf_checkpoint's config.json ({expected}); Physarum builds the model "
            f"from the HF config: fix or drop the flag")


_SPEC = "the job spec's own key"
_MEGA = "megatron-core's setting, in the spec's `megatron:` section (train_backend megatron)"
# Megatron flag -> megatron-core config field, where the names differ
MEGATRON_FIELD = {
    "accumulate-allreduce-grads-in-fp32": "grad_reduce_in_fp32",
    "no-gradient-accumulation-fusion": "gradient_accumulation_fusion",
    "no-rope-fusion": "apply_rope_fusion",
    "no-bias-swiglu-fusion": "bias_activation_fusion",
    "no-masked-softmax-fusion": "masked_softmax_fusion",
}
NEGATED = {"no-gradient-accumulation-fusion", "no-rope-fusion", "no-bias-swiglu-fusion", "no-masked-softmax-fusion"}

MEGATRON: dict[str, Flag] = {
    # layout
    "tensor-model-parallel-size": Flag("mapped", 1, _SPEC + " tensor_model_parallel_size"),
    "pipeline-model-parallel-size": Flag("mapped", 1, _SPEC + " pipeline_model_parallel_size"),
    "context-parallel-size": Flag("mapped", 1, "1 only: context parallelism is not supported"),
    "expert-model-parallel-size": Flag("mapped", 1, "1 only: MoE models are not supported"),
    "expert-tensor-parallel-size": Flag("mapped", 1, "1 only: MoE models are not supported"),
    "sequence-parallel": Flag("mapped", False, _MEGA + " sequence_parallel (dropped, as Megatron does, without "
                                                      "tensor parallelism)", bare=True),
    "decoder-last-pipeline-num-layers": Flag("refused", None, "uneven pipeline stages are not supported"),
    "use-distributed-optimizer": Flag("mapped", False, _SPEC + " use_distributed_optimizer", bare=True),
    # optimizer and schedule
    "optimizer": Flag("mapped", "adam", "adam only (Adam with decoupled weight decay, Megatron's adam)"),
    "lr-decay-style": Flag("mapped", "linear", _SPEC + " lr_decay_style (constant, linear, cosine)"),
    "lr-decay-iters": Flag("mapped", None, _SPEC + " lr_decay_iters"),
    "lr-warmup-iters": Flag("mapped", 0, _SPEC + " lr_warmup_iters"),
    "lr-warmup-fraction": Flag("mapped", None, _SPEC + " lr_warmup_iters = fraction × the run's optimizer steps"),
    "min-lr": Flag("mapped", 0.0, _SPEC + " min_lr"),
    "weight-decay": Flag("mapped", 0.01, _SPEC + " weight_decay"),
    "adam-beta1": Flag("mapped", 0.9, _SPEC + " adam_beta1"),
    "adam-beta2": Flag("mapped", 0.999, _SPEC + " adam_beta2"),
    "adam-eps": Flag("mapped", 1e-8, _SPEC + " adam_eps"),
    "optimizer-cpu-offload": Flag("mapped", False, _MEGA, bare=True),
    "overlap-cpu-optimizer-d2h-h2d": Flag("mapped", False, _MEGA, bare=True),
    "use-precision-aware-optimizer": Flag("mapped", False, _MEGA, bare=True),
    # numerics and memory
    "attention-dropout": Flag("mapped", 0.1, _MEGA),
    "hidden-dropout": Flag("mapped", 0.1, _MEGA),
    "attention-softmax-in-fp32": Flag("mapped", False, _MEGA, bare=True),
    "accumulate-allreduce-grads-in-fp32": Flag("mapped", False, _MEGA + " grad_reduce_in_fp32", bare=True),
    "recompute-granularity": Flag("mapped", None, _MEGA),
    "recompute-method": Flag("mapped", None, _MEGA),
    "recompute-num-layers": Flag("mapped", None, _MEGA),
    "deterministic-mode": Flag("mapped", False, _MEGA, bare=True),
    "no-gradient-accumulation-fusion": Flag("mapped", False, _MEGA + " gradient_accumulation_fusion: false",
                                            bare=True),
    "no-rope-fusion": Flag("mapped", False, _MEGA + " apply_rope_fusion: false", bare=True),
    "no-bias-swiglu-fusion": Flag("mapped", False, _MEGA + " bias_activation_fusion: false", bare=True),
    "no-masked-softmax-fusion": Flag("mapped", False, _MEGA + " masked_softmax_fusion: false", bare=True),
    "attention-backend": Flag("mapped", "auto", "the backends pick their attention kernel (flash attention through "
                                                "megatron-core / torch SDPA on GPUs)", warn=True),
    "bf16": Flag("mapped", False, "the spec's bf16 (its default: bf16 on GPUs, float32 on CPU)", bare=True),
    "fp16": Flag("refused", False, "fp16 training needs dynamic loss scaling, which Physarum does not implement; "
                                   "use --bf16", bare=True),
    "spec": Flag("mapped", None, "the megatron backend builds the layer spec from the HF config's model_type",
                 warn=True, nargs=True),
}
