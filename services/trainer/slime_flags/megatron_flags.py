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

from services.trainer.models.families import EXPERT_COUNT_FIELDS, SIGMOID_ROUTERS, language_model_config
from services.trainer.slime_flags.flags import Flag


@dataclass(frozen=True)
class Arch:
    """An architecture flag: `expected(hf_config)` is the value the flag must have for this model (None: the
    config does not say, so any value is accepted); `given(value, hf_config)`, when set, reads the flag's value
    into the same form."""

    expected: Callable[[dict[str, Any]], Any]
    bare: bool = False
    given: Callable[[Any, dict[str, Any]], Any] | None = None


# What each family's transformers implementation does that its config.json does not say in a field.
ONE_PLUS_NORM = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma", "gemma2", "gemma3"}  # RMSNorm scales by (1 + w)
GATED_ATTENTION = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}  # q_proj doubled: a sigmoid gate on attention's output
QK_NORM = {"qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo2", "gemma3"}  # per-head q/k RMSNorm
INTERLEAVED_ROTARY = {"glm4"}  # rotates (even, odd) pairs, not the two halves (glm4_moe rotates halves)
POST_NORMS = {"glm4"}  # an RMSNorm after attention and after the MLP, before each residual add
# sigmoid scores with a learned expert bias (e_score_correction_bias); GLM-5 routes as DeepSeek-V3
SIGMOID_ROUTER = set(SIGMOID_ROUTERS) | {"glm_moe_dsa"}
SHARED_EXPERT_GATE = {"qwen2_moe", "qwen3_next", "qwen3_5_moe"}  # a sigmoid gate on the shared expert's output


def _get(key: str, default: Any = None) -> Callable[[dict[str, Any]], Any]:
    return lambda cfg: cfg.get(key, default)


def _rope(key: str, default: Any = None) -> Callable[[dict[str, Any]], Any]:
    """A RoPE field: top level (older config.json) or in rope_parameters / rope_scaling (transformers 5)."""
    def read(cfg: dict[str, Any]) -> Any:
        for where in (cfg, cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}):
            if where.get(key) is not None:
                return where[key]
        return default
    return read


def _head_dim(cfg: dict[str, Any]) -> Any:
    if "kv_lora_rank" in cfg:  # multi-latent attention: its own head dims (qk-head-dim, v-head-dim)
        return None
    if cfg.get("head_dim"):
        return cfg["head_dim"]
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return None


def _gqa(cfg: dict[str, Any]) -> Any:
    kv, heads = cfg.get("num_key_value_heads"), cfg.get("num_attention_heads")
    return None if kv is None or heads is None else kv < heads


def _family(cfg: dict[str, Any]) -> str:
    return str(cfg.get("model_type", "")).removesuffix("_text")


def _in(families: set[str]) -> Callable[[dict[str, Any]], bool]:
    return lambda cfg: _family(cfg) in families


def _num_experts(cfg: dict[str, Any]) -> Any:
    """The routed experts per MoE layer; 0 for a dense model (a config.json of a family without expert fields)."""
    for key in EXPERT_COUNT_FIELDS:
        if cfg.get(key) is not None:
            return cfg[key]
    return 0 if "model_type" in cfg else None


def _moe(read: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """A MoE field: None (not checked) for a dense model."""
    return lambda cfg: read(cfg) if _num_experts(cfg) else None


def _shared_expert_size(cfg: dict[str, Any]) -> Any:
    if cfg.get("shared_expert_intermediate_size") is not None:  # Qwen
        return cfg["shared_expert_intermediate_size"]
    if cfg.get("n_shared_experts"):  # DeepSeek, GLM: n shared experts of the routed experts' size
        return cfg["n_shared_experts"] * cfg["moe_intermediate_size"]
    return 0


def _moe_layers(cfg: dict[str, Any]) -> Any:
    """Megatron's --moe-layer-freq as a list: 1 where the HF model's layer is MoE, 0 where it is dense."""
    num_layers = cfg.get("num_hidden_layers")
    if not num_layers:
        return None
    if cfg.get("mlp_layer_types"):  # GLM-4.7-Flash: "dense" or "sparse" per layer
        dense = {i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind != "sparse"}
    elif "first_k_dense_replace" in cfg:  # DeepSeek, GLM
        dense = set(range(cfg["first_k_dense_replace"] or 0))
    else:  # Qwen: every decoder_sparse_step-th layer, but mlp_only_layers
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = {i for i in range(num_layers) if (i + 1) % step} | set(cfg.get("mlp_only_layers") or ())
    return [0 if i in dense else 1 for i in range(num_layers)]


def _pre_softmax(cfg: dict[str, Any]) -> Any:
    """--moe-router-pre-softmax: a softmax router's top-k weights unrenormalized (HF's norm_topk_prob false); a
    sigmoid router ignores it in megatron-core, so any value agrees."""
    if _family(cfg) in SIGMOID_ROUTER or "norm_topk_prob" not in cfg:
        return None
    return not cfg["norm_topk_prob"]


def _yarn(key: str, default: Any) -> Callable[[dict[str, Any]], Any]:
    """A YaRN rotary field (DeepSeek's --rotary-scaling-factor, --mscale, --mscale-all-dim); without YaRN the factor
    is 1 (no scaling) and the mscales weigh nothing, so any value of them agrees."""
    def read(cfg: dict[str, Any]) -> Any:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type")) != "yarn":
            return 1.0 if key == "factor" else None
        return rope.get(key) if rope.get(key) is not None else default
    return read


def _attention_variant(cfg: dict[str, Any]) -> Any:
    """--experimental-attention-variant: dsa for GLM-5's sparse attention; not checked here for the families with
    linear-attention layers (their gated delta nets); none (plain attention) for the rest."""
    if _family(cfg) == "glm_moe_dsa":
        return "dsa"
    if "linear_attention" in (cfg.get("layer_types") or []) or _family(cfg) == "qwen3_next":
        return None
    return "none"


def _layer_pattern(value: Any, cfg: dict[str, Any]) -> Any:
    """--moe-layer-freq's value: an int N (every N-th layer) or a Python list expression like "([0]*3+[1]*58)"."""
    import ast

    text = str(value).strip().strip("'\"")
    if text.isdigit():
        every = int(text)
        return [1 if i % every == 0 else 0 for i in range(cfg.get("num_hidden_layers") or 0)]

    def evaluate(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [evaluate(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)

    try:
        return evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        return text


ARCH: dict[str, Arch] = {
    "num-layers": Arch(_get("num_hidden_layers")),
    "hidden-size": Arch(_get("hidden_size")),
    "ffn-hidden-size": Arch(_get("intermediate_size")),
    "num-attention-heads": Arch(_get("num_attention_heads")),
    "num-query-groups": Arch(_get("num_key_value_heads")),
    "group-query-attention": Arch(_gqa, bare=True),
    "kv-channels": Arch(_head_dim),
    "norm-epsilon": Arch(lambda cfg: cfg.get("rms_norm_eps", cfg.get("layer_norm_eps"))),
    "rotary-base": Arch(_rope("rope_theta")),
    "vocab-size": Arch(_get("vocab_size")),
    "max-position-embeddings": Arch(_get("max_position_embeddings")),
    "swiglu": Arch(lambda cfg: cfg.get("hidden_act", "silu") == "silu" if "hidden_act" in cfg else None, bare=True),
    "normalization": Arch(lambda cfg: "RMSNorm" if "rms_norm_eps" in cfg else None),
    "disable-bias-linear": Arch(lambda cfg: not cfg.get("mlp_bias", False), bare=True),
    # multi-latent attention's projections have no bias whatever the flag says (megatron-core builds them without)
    "add-qkv-bias": Arch(lambda cfg: None if "kv_lora_rank" in cfg else
                         cfg.get("attention_bias", cfg.get("model_type") == "qwen2"), bare=True),
    # MLA's q and kv latent norms are Megatron's qk_layernorm too; GLM-4.5 says use_qk_norm
    "qk-layernorm": Arch(lambda cfg: _family(cfg) in QK_NORM or bool(cfg.get("use_qk_norm"))
                         or "kv_lora_rank" in cfg, bare=True),
    "untie-embeddings-and-output-weights": Arch(lambda cfg: not cfg.get("tie_word_embeddings", True), bare=True),
    "use-rotary-position-embeddings": Arch(lambda cfg: True, bare=True),
    "position-embedding-type": Arch(lambda cfg: "rope"),
    "no-position-embedding": Arch(lambda cfg: True, bare=True),  # no learned absolute positions: RoPE only
    "rotary-scaling-factor": Arch(_yarn("factor", None)),
    "mscale": Arch(_yarn("mscale", 1.0)),
    "mscale-all-dim": Arch(_yarn("mscale_all_dim", 0.0)),
    "rotary-percent": Arch(lambda cfg: float(_rope("partial_rotary_factor", 1.0)(cfg))),
    # MLA's rotary layout is the converter's business: not checked there
    "rotary-interleaved": Arch(lambda cfg: None if "kv_lora_rank" in cfg else _family(cfg) in INTERLEAVED_ROTARY,
                               bare=True),
    "apply-layernorm-1p": Arch(_in(ONE_PLUS_NORM), bare=True),
    "post-mlp-layernorm": Arch(_in(POST_NORMS), bare=True),
    "post-self-attn-layernorm": Arch(_in(POST_NORMS), bare=True),
    "attention-output-gate": Arch(lambda cfg: _family(cfg) in GATED_ATTENTION or bool(cfg.get("attn_output_gate")),
                                  bare=True),
    "use-gated-attention": Arch(lambda cfg: _family(cfg) in GATED_ATTENTION or bool(cfg.get("attn_output_gate")),
                                bare=True),
    # mixture of experts
    "num-experts": Arch(_num_experts),
    "moe-router-topk": Arch(_moe(_get("num_experts_per_tok"))),
    "moe-ffn-hidden-size": Arch(_moe(_get("moe_intermediate_size"))),
    "moe-shared-expert-intermediate-size": Arch(_moe(_shared_expert_size)),
    "moe-layer-freq": Arch(_moe(_moe_layers), given=_layer_pattern),
    "moe-router-score-function": Arch(_moe(lambda cfg: "sigmoid" if _family(cfg) in SIGMOID_ROUTER else "softmax")),
    "moe-router-enable-expert-bias": Arch(_moe(_in(SIGMOID_ROUTER)), bare=True),
    "moe-router-topk-scaling-factor": Arch(_moe(_get("routed_scaling_factor"))),
    "moe-router-num-groups": Arch(_moe(_get("n_group"))),
    "moe-router-group-topk": Arch(_moe(_get("topk_group"))),
    "moe-router-pre-softmax": Arch(_moe(_pre_softmax), bare=True),
    "moe-shared-expert-gate": Arch(_moe(lambda cfg: _family(cfg) in SHARED_EXPERT_GATE
                                        and bool(_shared_expert_size(cfg))), bare=True),
    # multi-latent attention (DeepSeek-V3)
    "multi-latent-attention": Arch(lambda cfg: "kv_lora_rank" in cfg, bare=True),
    "q-lora-rank": Arch(_get("q_lora_rank")),
    "kv-lora-rank": Arch(_get("kv_lora_rank")),
    "qk-head-dim": Arch(_get("qk_nope_head_dim")),
    "qk-pos-emb-head-dim": Arch(_get("qk_rope_head_dim")),
    "v-head-dim": Arch(_get("v_head_dim")),
    # DeepSeek sparse attention (GLM-5)
    "experimental-attention-variant": Arch(lambda cfg: _attention_variant(cfg)),
    "dsa-indexer-n-heads": Arch(_get("index_n_heads")),
    "dsa-indexer-head-dim": Arch(_get("index_head_dim")),
    "dsa-indexer-topk": Arch(_get("index_topk")),
}


def _equal(given: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(given, bool):
        return bool(given) == bool(expected)
    if isinstance(expected, list):
        return given == expected
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        try:
            return math.isclose(float(given), float(expected), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return str(given).lower() == str(expected).lower()


def check_arch(flag: str, value: Any, hf_config: dict[str, Any] | None) -> str:
    """"" when the architecture flag agrees with the HF config (or the config does not say); else why not. A
    multimodal checkpoint's flags are checked against its language model (text_config)."""
    if hf_config is None:
        return f"--{flag}: cannot be checked: hf_checkpoint has no readable config.json"
    cfg = language_model_config(hf_config)
    cfg = {**cfg, "model_type": hf_config.get("model_type", cfg.get("model_type"))}
    arch = ARCH[flag]
    expected = arch.expected(cfg)
    given = arch.given(value, cfg) if arch.given else value
    if expected is None or _equal(given, expected):
        return ""
    return (f"--{flag} {value} disagrees with hf_checkpoint's config.json ({expected}); Physarum builds the model "
            f"from the HF config: fix or drop the flag")


_SPEC = "the job spec's own key"
FP8_TRAINING_REFUSAL = "FP8 training is not supported: the backends train in bf16 or float32; drop it"
_MEGA = "megatron-core's setting, in the spec's `megatron:` section (train_backend megatron)"
_WEIGHTS_ONLY = ("a --load of slime's checkpoint reads its weights only (rollout 0, a fresh optimizer), of Physarum's "
                 "its whole state; for weights only, load an HF export (save_hf)")
_NO_MOE = ("the megatron backend trains Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, DeepSeek-V3, GLM-4.5/4.7, GLM-4.7-Flash, "
           "GLM-5 and MiniMax-M2; train_backend fsdp trains the other MoE families")
_MOE_KERNEL = ("the backends set their own: megatron all-to-all dispatch without grouped GEMM or fused permutes, "
               "fsdp transformers' own MoE layers")
# Megatron flag -> megatron-core config field, where the names differ
MEGATRON_FIELD = {
    "accumulate-allreduce-grads-in-fp32": "grad_reduce_in_fp32",
    "no-gradient-accumulation-fusion": "gradient_accumulation_fusion",
    "no-rope-fusion": "apply_rope_fusion",
    "no-bias-swiglu-fusion": "bias_activation_fusion",
    "no-masked-softmax-fusion": "masked_softmax_fusion",
    "decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
    "decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
}
NEGATED = {"no-gradient-accumulation-fusion", "no-rope-fusion", "no-bias-swiglu-fusion", "no-masked-softmax-fusion"}

MEGATRON: dict[str, Flag] = {
    # layout
    "tensor-model-parallel-size": Flag("mapped", 1, _SPEC + " tensor_model_parallel_size"),
    "pipeline-model-parallel-size": Flag("mapped", 1, _SPEC + " pipeline_model_parallel_size"),
    "context-parallel-size": Flag("mapped", 1, _SPEC + " context_parallel_size (both backends: Megatron's "
                                                   "load-balanced chunks)"),
    "expert-model-parallel-size": Flag("mapped", 1, _SPEC + " expert_model_parallel_size (" + _NO_MOE + ")"),
    "expert-tensor-parallel-size": Flag("mapped", 1, _SPEC + " expert_tensor_parallel_size (1, or the "
                                                     "tensor-parallel size)"),
    "sequence-parallel": Flag("mapped", False, _MEGA + " sequence_parallel (each tensor-parallel rank holds a "
                                                      "slice of every row, padded to a multiple of the TP size; "
                                                      "dropped, as Megatron does, without tensor parallelism)",
                              bare=True),
    "decoder-first-pipeline-num-layers": Flag("mapped", None, _MEGA + " num_layers_in_first_pipeline_stage (the "
                                                                    "other stages split the rest evenly)"),
    "decoder-last-pipeline-num-layers": Flag("mapped", None, _MEGA + " num_layers_in_last_pipeline_stage (the "
                                                                   "other stages split the rest evenly)"),
    "use-distributed-optimizer": Flag("mapped", False, _SPEC + " use_distributed_optimizer", bare=True),
    # checkpoints (slime's --load, --save: flags.py)
    "ckpt-step": Flag("mapped", None, _SPEC + " ckpt_step (the iteration of --load to read)"),
    "ckpt-format": Flag("mapped", "torch_dist", "train_backend megatron writes torch_dist, which Megatron-LM loads "
                                                "whatever its --ckpt-format (fsdp writes its own dcp/)", warn=True),
    "finetune": Flag("refused", False, _WEIGHTS_ONLY, bare=True),
    "no-load-optim": Flag("refused", False, _WEIGHTS_ONLY, bare=True),
    "no-load-rng": Flag("refused", False, _WEIGHTS_ONLY, bare=True),
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
    "optimizer-cpu-offload": Flag("mapped", False, _MEGA + " (megatron-core's hybrid optimizer keeps the "
                                  "optimizer state and its step on the host; with the distributed optimizer)",
                                  bare=True),
    "optimizer-offload-fraction": Flag("mapped", 1.0, _MEGA + " (the share of the state kept on the host; 1.0, "
                                       "Megatron-LM's default, when only --optimizer-cpu-offload is given)"),
    "overlap-cpu-optimizer-d2h-h2d": Flag("mapped", False, _MEGA, bare=True),
    "use-precision-aware-optimizer": Flag("mapped", False, _MEGA + "; megatron-core runs it on TransformerEngine's "
                                          "FusedAdam or, with --optimizer-cpu-offload, on its hybrid optimizer: "
                                          "refused at submit without either", bare=True),
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
    # FP8 training (TransformerEngine's recipes): the backends train in bf16 or float32
    **{name: Flag("refused", default, FP8_TRAINING_REFUSAL, bare=default is False) for name, default in (
        ("fp8-format", None), ("fp8-recipe", "delayed"), ("fp8-margin", 0), ("fp8-interval", 1),
        ("fp8-amax-history-len", 1), ("fp8-amax-compute-algo", "most_recent"), ("fp8-param-gather", False))},
    # mixture-of-experts runtime settings (the architecture's are checked, above)
    "moe-grouped-gemm": Flag("mapped", False, _MOE_KERNEL, warn=True, bare=True),
    "moe-token-dispatcher-type": Flag("mapped", "allgather", _MOE_KERNEL, warn=True),
    "moe-permute-fusion": Flag("mapped", False, _MOE_KERNEL, warn=True, bare=True),
    "moe-router-dtype": Flag("mapped", None, "the megatron backend routes in float32, the fsdp backend as "
                                             "transformers' MoE layers do", warn=True),
    "moe-token-drop-policy": Flag("mapped", "probs", "no token is dropped: transformers' MoE layers have no expert "
                                                     "capacity", warn=True),
    "moe-aux-loss-coeff": Flag("mapped", 0.0, _SPEC + " moe_aux_loss_coeff (both backends add Megatron's aux_loss to "
                                                 "the policy loss)"),
    "moe-router-load-balancing-type": Flag("mapped", "aux_loss", _SPEC + " moe_router_load_balancing_type (aux_loss, "
                                                                         "seq_aux_loss, global_aux_loss on megatron "
                                                                         "only, or none; none under "
                                                                         "--moe-aux-loss-coeff 0)"),
    "moe-router-bias-update-rate": Flag("mapped", 1e-3, "the routers' expert bias (e_score_correction_bias) stays "
                                                        "as the checkpoint has it, as with rate 0", warn=True),
    "moe-enable-deepep": Flag("mapped", False, "megatron-core's all-to-all token dispatcher: DeepEP is not in the "
                                               "trainer's image; the experts and their routing are the same, the "
                                               "dispatch slower across nodes", warn=True, bare=True),
    "make-vocab-size-divisible-by": Flag("mapped", 128, _MEGA + " make_vocab_size_divisible_by (the megatron "
                                                        "backend pads the vocab to a multiple of it × the TP size, as "
                                                        "slime's checkpoints are; padding rows are never sampled and "
                                                        "are dropped from HF exports)"),
    "dsa-indexer-loss-coeff": Flag("mapped", 0.0, _MEGA + " dsa_indexer_loss_coeff (GLM-5: the indexer's KL loss; "
                                                     "at 0 the indexer stays as loaded, as transformers keeps it)"),
    "dsa-indexer-use-sparse-loss": Flag("mapped", False, _MEGA + " dsa_indexer_use_sparse_loss", bare=True),
    "spec": Flag("mapped", None, "the megatron backend builds the layer spec from the HF config's model_type",
                 warn=True, nargs=True),
}
