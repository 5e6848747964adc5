"""The training settings a backend takes (`TrainConfig`): the algorithm, the optimizer, the models beside the policy.

Field names and defaults are slime's flags; each field is a job-spec key declared here once. Torch-free, so a spec
is checked against it at submit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from services.common import plugins
from services.common.config import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Rule, check_fields, field, shared
from services.common.settings.rollout import LossType, RolloutConfig
from services.trainer.algorithms.names import (
    ADVANTAGE_ESTIMATORS,
    KL_LOSS_TYPES,  # noqa: F401 - re-exported: the names a config accepts
    KL_REWARD_ESTIMATORS,
    AdvantageEstimator,
    KLLossType,
)

log = logging.getLogger(__name__)

# moe/load_balancing.py's LOAD_BALANCING_TYPES
MoELoadBalancingType = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"]
LR_DECAY_STYLES = ("constant", "linear", "cosine")
LRDecayStyle = Literal["constant", "linear", "cosine"]
OpdType = Literal["sglang", "megatron"]
CUSTOM_LOSS_SIGNATURE = "def fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)"
BETA = Rule(lambda v: 0 <= v < 1, "in [0, 1)")
FINITE = Rule(math.isfinite, "finite")



@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The algorithm and optimizer settings a backend trains with (slime's flags, Megatron's optimizer defaults).
    The sampling settings it shares with the rollout are RolloutConfig's declarations."""

    args: dict[str, Any] = field({}, "the whole job spec, for the slime hooks (slime's `args`)", internal=True)
    loss_type: LossType = shared(RolloutConfig, "loss_type")
    custom_loss_function_path: str = field("", "custom_loss: import path of " + CUSTOM_LOSS_SIGNATURE)
    custom_reward_post_process_path: str = field(
        "", "import path of def fn(args, samples) -> (raw_rewards, rewards): replaces the group normalization of "
            "rewards (called on each rank's samples, whole groups)")
    custom_advantage_function_path: str = field(
        "", "import path of def fn(args, rollout_data): sets rollout_data['advantages'] and ['returns'] instead of "
            "advantage_estimator's (normalize_advantages still applies)")
    custom_tis_function_path: str = field(
        "", "import path of slime's TIS function fn(args, *, pg_loss, train_log_probs, rollout_log_probs, "
            "loss_masks, ...) -> (pg_loss, loss_masks, metrics), used under use_tis instead of the truncated ratio "
            "(e.g. slime's MIS helper)")
    use_opd: bool = field(False, "on-policy distillation: every token's advantage gets -opd_kl_coef·(log π − log "
                                 "π_teacher) of the sampled token, on top of advantage_estimator's (slime's)")
    opd_type: OpdType | None = field(
        None, "where the teacher's log-probs come from: sglang (a teacher engine at opd_teacher_url, asked by the "
              "rollout service) or megatron (a teacher model in the trainer, from opd_teacher_load; either "
              "train_backend)")
    opd_kl_coef: float = field(1.0, "weight of on-policy distillation's reverse-KL term", FINITE)
    advantage_estimator: AdvantageEstimator = field(
        "grpo", "how rewards become per-token advantages: " + ", ".join(ADVANTAGE_ESTIMATORS))
    n_samples_per_prompt: int = shared(RolloutConfig, "n_samples_per_prompt")
    reward_key: str = shared(RolloutConfig, "reward_key")
    rollout_temperature: float = shared(RolloutConfig, "rollout_temperature")
    multimodal_keys: dict[str, str] = shared(RolloutConfig, "multimodal_keys")
    freeze_vision: bool = field(False, "multimodal_keys: the vision tower's weights stay as loaded (only the language "
                                       "model and the merger train)")
    lora_rank: int = field(0, "LoRA: the adapters' rank r (0: train the full weights); fsdp backend: the base "
                              "model frozen, only each targeted Linear's A [r, in] and B [out, r] train",
                           NON_NEGATIVE)
    lora_alpha: float = field(16.0, "LoRA: the adapter's output is scaled by lora_alpha / lora_rank", POSITIVE)
    lora_dropout: float = field(0.0, "LoRA: dropout on the adapter's input in the training forward",
                                Rule(lambda v: 0 <= v < 1, "in [0, 1)"))
    target_modules: list[str] = field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "LoRA: the Linear layers that get adapters, by name or dotted name suffix (PEFT's rule; never lm_head)")
    lora_save_merged: bool = field(False, "LoRA: the HF export also writes the merged model (W + alpha/r · B @ A) "
                                          "under merged/ beside the adapter")
    lora_share_pool: bool = field(False, "LoRA: run beside the running lora_share_pool jobs of the same base model "
                                         "(hf_checkpoint, train_backend, target_modules, bf16, sglang_* engine "
                                         "options) on this trainer and engine pool, the base held once, each job's "
                                         "adapter stepped in turn; otherwise it waits in the queue as any job does")
    global_batch_size: int | None = field(
        None, "samples per optimizer step; trailing samples that do not fill a step are dropped (None: the rollout's "
              "samples / num_steps_per_rollout)", AT_LEAST_ONE)
    num_steps_per_rollout: int | None = field(
        None, "optimizer steps per rollout, when global_batch_size is unset (None: 1)", AT_LEAST_ONE)
    micro_batch_size: int = field(1, "samples per forward/backward, packed into one row when padding them to the "
                                     "longest would add over 25 % padding (padded otherwise, and where the model "
                                     "cannot keep packed sequences apart); gradients accumulate over a step",
                                  AT_LEAST_ONE)
    use_dynamic_batch_size: bool = field(False, "fill micro-batches up to max_tokens_per_gpu instead, longest "
                                                "sample first (first-fit decreasing)")
    max_tokens_per_gpu: int | None = field(None, "token budget of a micro-batch under use_dynamic_batch_size",
                                           AT_LEAST_ONE)
    log_probs_chunk_size: int = field(
        1024, "response tokens per chunk of the fused log-prob and entropy computation from the final hidden states "
              "and the LM head, forward and backward, which never holds the [tokens × vocab] logits; -1: project "
              "every response token onto the vocabulary at once", Rule(lambda v: v == -1 or v >= 1, "-1 or >= 1"))
    compile_layers: bool = field(False, "torch.compile each decoder layer (one compiled graph shared by every "
                                        "layer, dynamic shapes); the first steps pay the compile")
    eps_clip: float = field(0.2, "PPO clip range: ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]",
                            NON_NEGATIVE)
    eps_clip_high: float | None = field(None, "upper clip range (DAPO clip-higher); None: eps_clip", NON_NEGATIVE)
    eps_clip_c: float | None = field(None, "dual-clip PPO bound (> 1) on the loss of negative advantages",
                                     Rule(lambda v: v > 1, "> 1 (dual-clip PPO)"))
    value_clip: float = field(0.2, "ppo: clip range of the critic's value update", NON_NEGATIVE)
    gamma: float = field(1.0, "discount of ppo's GAE and reinforce_plus_plus's returns", NON_NEGATIVE)
    lambd: float = field(1.0, "GAE lambda (ppo)", NON_NEGATIVE)
    num_critic_only_steps: int = field(0, "ppo: train only the critic for the first N rollouts", NON_NEGATIVE)
    normalize_advantages: bool = field(False, "whiten advantages over the rollout's unmasked tokens")
    use_kl_loss: bool = field(False, "keep a frozen reference model and compute a KL-to-reference loss")
    kl_loss_coef: float = field(0.0, "weight of the KL loss (needs use_kl_loss)", NON_NEGATIVE)
    kl_loss_type: KLLossType = field("k1", "KL estimator: k1, k2, k3 or low_var_kl")
    use_unbiased_kl: bool = field(False, "multiply the KL loss by the importance ratio π/π_old (DeepSeek-V3.2)")
    kl_coef: float = field(0.0, "KL reward shaping (ppo and the reinforce_plus_plus family): r_t -= kl_coef·KL",
                           FINITE)
    entropy_coef: float = field(0.0, "weight of the entropy bonus (subtracted from the loss)", FINITE)
    use_tis: bool = field(False, "truncated importance sampling by the trainer/engine log-prob ratio")
    tis_clip: float = field(2.0, "upper clamp of the TIS weight", NON_NEGATIVE)
    tis_clip_low: float = field(0.0, "lower clamp of the TIS weight", NON_NEGATIVE)
    use_rollout_logprobs: bool = field(False, "use the engines' log-probs as the old policy instead of recomputing")
    disable_grpo_std_normalization: bool = field(False, "group mean baseline only, no std division (Dr.GRPO)")
    disable_rewards_normalization: bool = field(False, "use raw rewards, no group baseline")
    calculate_per_token_loss: bool = field(False, "global token mean instead of the mean of per-sample means")
    lr: float = field(1e-6, "peak learning rate", POSITIVE)
    min_lr: float = field(0.0, "learning rate at the end of the decay", NON_NEGATIVE)
    lr_warmup_iters: int = field(0, "optimizer steps of linear warmup from 0", NON_NEGATIVE)
    lr_decay_style: LRDecayStyle = field("linear", "constant, linear or cosine decay after warmup")
    lr_decay_iters: int | None = field(
        None, "optimizer step at which the decay reaches min_lr (a job's None: its last step, as slime's train_iters)")
    weight_decay: float = field(0.01, "AdamW decoupled weight decay (not on biases and norms)", NON_NEGATIVE)
    adam_beta1: float = field(0.9, "Adam beta1", BETA)
    adam_beta2: float = field(0.999, "Adam beta2", BETA)
    adam_eps: float = field(1e-8, "Adam epsilon", POSITIVE)
    clip_grad: float = field(1.0, "max global gradient norm; 0 disables clipping", NON_NEGATIVE)
    seed: int = field(1234, "random seed of the trainer")
    bf16: bool | None = field(None, "train in bfloat16 (fp32 master weights, log-probs and losses); None: bf16 on "
                                    "CUDA, float32 on CPU (slime's --bf16)")
    fp16: bool = field(False, "slime's --fp16: refused (no loss scaling); use bf16")
    allow_tf32: bool = field(True, "TF32 tensor cores for float32 matmuls on CUDA; false: bit-faithful float32")
    use_routing_replay: bool = field(
        False, "MoE: the old policy's forward records the experts each token is routed to and the training forwards "
               "route to those experts (the gate weights still from the current router)")
    use_rollout_routing_replay: bool = shared(RolloutConfig, "use_rollout_routing_replay")
    moe_aux_loss_coeff: float = field(
        0.0, "MoE load-balancing loss weight (Megatron's aux_loss, summed over the MoE layers, per micro-batch), "
             "added to the policy loss (fsdp: Qwen3-MoE, Qwen3.5-MoE by softmax scores, GLM-4-MoE, DeepSeek-V3 by "
             "normalized sigmoid scores; megatron: megatron-core's routers)", NON_NEGATIVE)
    moe_router_load_balancing_type: MoELoadBalancingType = field(
        "aux_loss", "the load-balancing loss moe_aux_loss_coeff weighs: aux_loss (per micro-batch), seq_aux_loss "
                    "(per sequence row), global_aux_loss (the experts' tokens counted over the data-parallel ranks "
                    "and the step's micro-batches; megatron only), or none")
    mtp_num_layers: int | None = field(
        None, "megatron: build this many of the checkpoint's multi-token-prediction layers after the decoder "
              "(MiMo, DeepSeek-V3, GLM-4.5+: num_nextn_predict_layers); their weights are loaded, saved and sent to "
              "the engines", AT_LEAST_ONE)
    enable_mtp_training: bool = field(False, "train the MTP layers on their loss, added to the policy loss")
    mtp_loss_scaling_factor: float = field(
        0.2, "weight of the MTP loss: each depth's mean cross-entropy of the trained response tokens, summed over the "
             "depths, times this / mtp_num_layers", NON_NEGATIVE)

    def __post_init__(self) -> None:
        if self.fp16:
            raise ValueError("fp16: not supported (fp16 training needs dynamic loss scaling, which Physarum does not "
                             "implement); use bf16")
        check_fields(self)
        if self.rollout_temperature <= 0:  # the trainer divides logits by it (the engines also accept 0: greedy)
            raise ValueError(f"rollout_temperature must be > 0, got {self.rollout_temperature}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be <= lr ({self.lr}), got {self.min_lr}")
        if self.tis_clip < self.tis_clip_low:
            raise ValueError(f"tis_clip must be >= tis_clip_low ({self.tis_clip_low}), got {self.tis_clip}")
        if self.eps_clip_high is None:
            object.__setattr__(self, "eps_clip_high", self.eps_clip)
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.kl_loss_coef != 0 and not self.use_kl_loss:
            raise ValueError(f"kl_loss_coef is {self.kl_loss_coef} but use_kl_loss is false")
        if self.use_kl_loss and self.loss_type == "sft_loss":
            raise ValueError("use_kl_loss applies to loss_type 'policy_loss' or 'custom_loss', not 'sft_loss'")
        if self.kl_coef != 0 and self.advantage_estimator not in KL_REWARD_ESTIMATORS:
            raise ValueError(f"kl_coef shapes rewards only for {', '.join(KL_REWARD_ESTIMATORS)}; advantage_estimator "
                             f"{self.advantage_estimator!r} ignores it (use use_kl_loss with kl_loss_coef instead)")
        if self.kl_coef != 0 and self.use_kl_loss:
            raise ValueError("kl_coef (KL as reward shaping) and use_kl_loss (KL as a loss) exclude each other")
        if self.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and \
                not self.normalize_advantages:
            raise ValueError(f"advantage_estimator {self.advantage_estimator!r} requires normalize_advantages: true "
                             "(as in slime)")
        if self.use_rollout_routing_replay and self.loss_type == "sft_loss":
            raise ValueError("use_rollout_routing_replay replays the engines' routing; sft_loss generates nothing")
        if self.use_tis and self.use_rollout_logprobs:
            raise ValueError("use_tis and use_rollout_logprobs cannot be set together: TIS weighs the recomputed "
                             "log-probs against the engines'")
        if self.use_opd and self.opd_type is None:
            raise ValueError("use_opd needs opd_type: sglang (a teacher engine) or megatron (a teacher model in the "
                             "trainer)")
        if self.opd_type is not None and not self.use_opd:
            raise ValueError(f"opd_type {self.opd_type!r} is set but use_opd is false")
        if self.use_opd and self.loss_type == "sft_loss":
            raise ValueError("use_opd applies to loss_type 'policy_loss' (it shapes the advantages), not 'sft_loss'")
        if self.lora_rank and not self.target_modules:
            raise ValueError("lora_rank is set but target_modules is empty")
        if self.lora_share_pool and not self.lora_rank:
            raise ValueError("lora_share_pool: a full-weight job's weights are the engines' whole model, so it keeps "
                             "the trainer and the engine pool to itself; set lora_rank to share them as a LoRA job")
        if self.lora_share_pool and (self.replays_routing or self.compile_layers or self.multimodal_keys):
            raise ValueError("lora_share_pool: jobs share one base model, which routing replay "
                             "(use_routing_replay, use_rollout_routing_replay), compile_layers and multimodal_keys "
                             "would each change for their job alone; unset them or lora_share_pool")
        if self.lora_rank and "lm_head" in self.target_modules:
            raise ValueError("target_modules: lm_head takes no adapter (the log-probs read its weight directly)")
        if self.enable_mtp_training and not self.mtp_num_layers:
            raise ValueError("enable_mtp_training needs mtp_num_layers (the MTP layers to train)")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ValueError("use_dynamic_batch_size needs max_tokens_per_gpu")
        if self.lr_decay_style != "constant" and self.lr_decay_iters is not None and \
                self.lr_decay_iters <= self.lr_warmup_iters:  # a constant lr has no decay to end
            raise ValueError(f"lr_decay_iters ({self.lr_decay_iters}) must be > lr_warmup_iters "
                             f"({self.lr_warmup_iters})")
        if (self.loss_type == "custom_loss") != bool(self.custom_loss_function_path):
            raise ValueError("loss_type 'custom_loss' and custom_loss_function_path go together "
                             f"(got loss_type {self.loss_type!r}, custom_loss_function_path "
                             f"{self.custom_loss_function_path!r})")
        for hook in ("custom_loss_function_path", "custom_reward_post_process_path", "custom_advantage_function_path",
                     "custom_tis_function_path"):
            if getattr(self, hook):  # imported by the backend once the job runs, never at validation
                plugins.check_allowed(getattr(self, hook), hook)
        if self.advantage_estimator == "cispo" and self.eps_clip < 1.0:
            log.warning("cispo with eps_clip %s keeps the lower clip bound %s; canonical CISPO uses eps_clip 1.0 and "
                        "a large eps_clip_high (e.g. 4.0)", self.eps_clip, 1.0 - self.eps_clip)

    @property
    def use_critic(self) -> bool:
        return self.advantage_estimator == "ppo" and self.loss_type == "policy_loss"

    @property
    def moe_aux_loss(self) -> bool:
        """Whether a load-balancing loss is added to the policy loss."""
        return self.moe_aux_loss_coeff > 0 and self.moe_router_load_balancing_type != "none"

    @property
    def replays_routing(self) -> bool:
        """MoE routing replay of either kind (slime: use_rollout_routing_replay implies use_routing_replay)."""
        return self.use_routing_replay or self.use_rollout_routing_replay

    @property
    def needs_teacher_model(self) -> bool:
        """On-policy distillation from a teacher model the trainer runs (opd_type megatron)."""
        return self.use_opd and self.opd_type == "megatron"

    @property
    def lora(self) -> bool:
        """Trains LoRA adapters on a frozen base model (lora_rank > 0)."""
        return self.lora_rank > 0

    @property
    def needs_ref_model(self) -> bool:
        return self.use_kl_loss or self.kl_coef != 0
