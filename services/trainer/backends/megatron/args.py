"""A job spec's `megatron:` section: Megatron's own flags, by their config field names, passed through unchanged.

slime hands Megatron's flags on as they are; here each key names a field of megatron-core's TransformerConfig,
OptimizerConfig or DistributedDataParallelConfig (a key in several goes to each), e.g. `attention_dropout: 0.1` or
`recompute_granularity: full`. Keys the backend derives itself (the architecture from the HF config, the layout and
the optimizer from the spec's own keys) are refused, naming where they come from.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidArgument

_ARCH = "is read from hf_checkpoint's config.json"
OWNED: dict[str, str] = {
    **{name: _ARCH for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
        "add_qkv_bias", "qk_layernorm", "rotary_base", "rope_scaling", "rope_scaling_factor", "num_moe_experts",
        "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_router_score_function",
        "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
        "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "moe_layer_freq", "rotary_percent",
        "multi_latent_attention")},
    **{name: f"is the job spec's own key: set `{name}` at the top level" for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
        "expert_tensor_parallel_size", "use_distributed_optimizer", "lr", "min_lr",
        "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")},
    "pipeline_model_parallel_layout": "is not supported: set num_layers_in_first_pipeline_stage and/or "
                                      "num_layers_in_last_pipeline_stage (slime: --decoder-first-pipeline-num-layers, "
                                      "--decoder-last-pipeline-num-layers)",
    **{name: "FP8/FP4 training is not supported: the backends train in bf16 or float32" for name in (
        "fp8", "fp8_recipe", "fp8_param", "fp8_dot_product_attention", "fp8_multi_head_attention", "fp4", "fp4_recipe",
        "fp4_param")},
    **{name: "is set from the job spec's `bf16` (fp32 main parameters and gradient reduction)" for name in (
        "params_dtype", "pipeline_dtype", "bf16", "fp16", "main_params_dtype", "main_grads_dtype")},
}


# Megatron-LM's model flags outside megatron-core's config classes that the backend honours -> their defaults
MODEL_KEYS: dict[str, Any] = {"make_vocab_size_divisible_by": 128}  # the padded vocab: a multiple of it × TP


@dataclass(frozen=True)
class MegatronArgs:
    """The `megatron:` section cut by the config class each key belongs to (`model`: MODEL_KEYS)."""

    transformer: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    ddp: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size_divisible_by(self) -> int:
        return self.model.get("make_vocab_size_divisible_by", MODEL_KEYS["make_vocab_size_divisible_by"])

    @property
    def pipeline_ends(self) -> dict[str, int | None]:
        """The first and last pipeline stages' decoder layers when the `megatron:` section makes them uneven."""
        return {"first": self.transformer.get("num_layers_in_first_pipeline_stage"),
                "last": self.transformer.get("num_layers_in_last_pipeline_stage")}

    @property
    def dropout(self) -> bool:
        """Whether training forwards must run in train mode (log-prob recomputes always run in eval mode)."""
        return any(self.transformer.get(name, 0.0) for name in ("hidden_dropout", "attention_dropout"))


_FIRST_IMPORT = threading.Lock()


def config_classes() -> dict[str, type]:
    """megatron-core's TransformerConfig, OptimizerConfig and DistributedDataParallelConfig by the part they configure.
    The job API checks specs in worker threads, and two threads importing megatron-core for the first time at once can
    each meet the other's half-run import cycle (ImportError: partially initialized module): one imports, the rest
    wait."""
    with _FIRST_IMPORT:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer import TransformerConfig
    return {"transformer": TransformerConfig, "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}


def split(args: Mapping[str, Any] | None) -> MegatronArgs:
    """Check every key of `args` against megatron-core's config classes and sort it into their overrides."""
    classes = config_classes()
    fields = {part: {f.name: f for f in dataclasses.fields(cls) if f.init} for part, cls in classes.items()}
    out: dict[str, dict[str, Any]] = {part: {} for part in (*classes, "model")}
    for key, value in (args or {}).items():
        if key in OWNED:
            raise InvalidArgument(f"megatron.{key}: {OWNED[key]}")
        if key in MODEL_KEYS:
            _check_type(key, value, MODEL_KEYS[key])
            if value < 1:
                raise InvalidArgument(f"megatron.{key}: expected a positive int, got {value!r}")
            out["model"][key] = value
            continue
        parts = [part for part in classes if key in fields[part]]
        if not parts:
            raise InvalidArgument(f"megatron.{key}: not a field of megatron-core's TransformerConfig, "
                                  "OptimizerConfig or DistributedDataParallelConfig")
        for part in parts:
            _check_type(key, value, fields[part][key].default)
            out[part][key] = value
    return MegatronArgs(**out)


def _check_type(key: str, value: Any, default: Any) -> None:
    """A value of the kind the field's scalar default has (Megatron's configs check few types themselves)."""
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
    want = kinds.get(type(default))
    if want and (not isinstance(value, want) or (isinstance(value, bool) and bool not in want)):
        raise InvalidArgument(f"megatron.{key}: expected {type(default).__name__} (default {default!r}), "
                              f"got {value!r}")


def build(cls: Callable[..., Any], what: str, values: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """cls(**values, **overrides); Megatron's own checks of the result come back as InvalidArgument."""
    try:
        return cls(**{**values, **overrides})
    except (ValueError, AssertionError, TypeError, RuntimeError) as err:
        if not overrides:
            raise
        keys = ", ".join(f"megatron.{k}" for k in overrides)
        raise InvalidArgument(f"{keys}: megatron-core's {what} refused them: {err}") from err


def check_optimizer(overrides: dict[str, Any], *, use_distributed_optimizer: bool) -> None:
    """Build megatron-core's OptimizerConfig as the backend does, so its own checks of the `megatron:` section fail
    the submit, not the job's start (nothing is allocated)."""
    import importlib.util

    from services.trainer.backends.megatron import offload

    optimizer_config = config_classes()["optimizer"]

    # megatron-core runs it on TransformerEngine's FusedAdam or on its CPU-offload optimizer; without either, its
    # check fails with a TypeError (comparing a missing version) rather than saying so
    if overrides.get("use_precision_aware_optimizer") and not overrides.get("optimizer_cpu_offload") \
            and importlib.util.find_spec("transformer_engine") is None:
        raise InvalidArgument("megatron.use_precision_aware_optimizer: megatron-core runs it only with "
                              "TransformerEngine's FusedAdam or with optimizer_cpu_offload, and TransformerEngine is "
                              "not installed in the trainer's image; drop it or offload the optimizer (slime: "
                              "--use-precision-aware-optimizer, --optimizer-cpu-offload)")
    if overrides.get("optimizer_cpu_offload") and not use_distributed_optimizer:
        raise InvalidArgument("megatron.optimizer_cpu_offload: runs with the distributed optimizer only "
                              "(megatron-core's float16 optimizer swaps in main parameters its hybrid optimizer does "
                              "not know); set use_distributed_optimizer (slime: --use-distributed-optimizer)")
    values = dict(optimizer="adam", use_distributed_optimizer=use_distributed_optimizer,
                  **offload.optimizer_fields(overrides))
    with offload.config_without_te():
        build(optimizer_config, "OptimizerConfig", values, overrides)
