"""The job spec: user input keyed by slime's flag names in snake_case, validated with pydantic.

Unknown keys are rejected by name (with a suggestion); a slime-style argument list converts to the same keys.
"""

from __future__ import annotations

import difflib
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from services.common import bounds
from services.common.errors import InvalidArgument


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN/inf would pass every `<=`

    job_id: str = ""
    # Model and data (slime: --hf-checkpoint, --prompt-data, --input-key, ...).
    hf_checkpoint: str
    prompt_data: str
    input_key: str = "input"
    label_key: str = "label"
    metadata_key: str = "metadata"
    apply_chat_template: bool = False
    rollout_shuffle: bool = False
    rollout_seed: int = 42
    # Rollout.
    num_rollout: int
    rollout_batch_size: int
    n_samples_per_prompt: int = 1
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_max_response_len: int = 1024
    rollout_stop: list[str] = []
    rollout_stop_token_ids: list[int] = []
    # Reward.
    rm_type: str = "math"
    custom_rm_path: str = ""
    reward_key: str = ""
    # Training (slime's algorithm flags; Megatron's optimizer and lr-schedule flags, with their defaults).
    train_backend: Literal["fsdp", "megatron"] = "fsdp"
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = "policy_loss"
    custom_loss_function_path: str = ""    # loaded (and its signature checked) when the spec is validated
    advantage_estimator: Literal["grpo", "gspo", "cispo", "ppo", "reinforce_plus_plus",
                                 "reinforce_plus_plus_baseline"] = "grpo"
    global_batch_size: int | None = None
    num_steps_per_rollout: int | None = None
    micro_batch_size: int = 1
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    value_clip: float = 0.2
    gamma: float = 1.0
    lambd: float = 1.0
    num_critic_only_steps: int = 0
    normalize_advantages: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    use_unbiased_kl: bool = False
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_rollout_logprobs: bool = False
    disable_grpo_std_normalization: bool = False
    disable_rewards_normalization: bool = False
    calculate_per_token_loss: bool = False
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    lr_decay_iters: int | None = None      # None: the run's last step (num_rollout × steps per rollout)
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    save_hf: str = ""                      # export the final model here ("{rollout_id}" is filled in)
    # Weight sync and timeouts (Physarum's own).
    update_weight_buffer_size: int = 64 << 20
    weight_sync_backend: Literal["gloo", "nccl"] = "gloo"
    weight_sync_timeout_s: float = 60.0
    lease_timeout_s: float = 60.0
    reward_timeout_s: float = 10.0
    rollout_timeout_s: float = 600.0

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        positive = ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "micro_batch_size",
                    "rollout_max_response_len", "update_weight_buffer_size")
        bounds.int64_fields(self)
        if self.job_id:
            bounds.job_id(self.job_id)
        for name in (*positive, "global_batch_size", "num_steps_per_rollout"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("lr", "rollout_temperature", "weight_sync_timeout_s", "lease_timeout_s", "reward_timeout_s",
                     "rollout_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.rollout_top_p <= 1:
            raise ValueError(f"rollout_top_p must be in (0, 1], got {self.rollout_top_p}")
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        gbs, steps = self.global_batch_size, self.num_steps_per_rollout
        if gbs is not None and steps is not None and gbs * steps != samples:
            raise ValueError(f"rollout_batch_size × n_samples_per_prompt ({samples}) must equal global_batch_size × "
                             f"num_steps_per_rollout ({gbs} × {steps} = {gbs * steps})")
        if gbs is not None and samples % gbs:
            raise ValueError(f"global_batch_size ({gbs}) must divide rollout_batch_size × n_samples_per_prompt "
                             f"({samples})")
        if steps is not None and samples % steps:
            raise ValueError(f"num_steps_per_rollout ({steps}) must divide rollout_batch_size × "
                             f"n_samples_per_prompt ({samples})")
        from services.trainer.train_config import train_config

        train_config(self)  # the training rules (and loading custom_loss_function_path) live in TrainConfig
        return self

    @property
    def resolved_global_batch_size(self) -> int:
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if self.global_batch_size is not None:
            return self.global_batch_size
        return samples // (self.num_steps_per_rollout or 1)

    @property
    def train_iters(self) -> int:
        """Optimizer steps of the whole run (slime: num_rollout × rollout samples // global_batch_size)."""
        return self.num_rollout * (self.rollout_batch_size * self.n_samples_per_prompt
                                   // self.resolved_global_batch_size)


    # Checkpoints and debug paths (slime's flags; reference/slime.md §5.2-5.3).
    save: str = ""                         # checkpoint root: iter_{rollout_id:07d}/ + latest_checkpointed_iteration.txt
    save_interval: int | None = None       # also save every N rollouts (a job with `save` always saves at its end)
    load: str = ""                         # resume from this checkpoint root (an HF directory: its weights only)
    ckpt_step: int | None = None           # the rollout id to load instead of the latest one
    ref_load: str = ""                     # the reference model: an HF directory or a checkpoint root
    ref_update_interval: int | None = None  # copy the policy into the reference model every N rollouts
    save_debug_rollout_data: str = ""      # dump each rollout's samples ("{rollout_id}" is filled in)
    load_debug_rollout_data: str = ""      # train on dumps instead of engines (implies debug_train_only)
    debug_rollout_only: bool = False       # generate rollouts, train nothing
    debug_train_only: bool = False         # no engines, no buffer: needs load_debug_rollout_data

    @model_validator(mode="after")
    def _check_checkpoints_and_debug(self) -> JobSpec:
        for name in ("save_interval", "ref_update_interval"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.ckpt_step is not None and (self.ckpt_step < 0 or not self.load):
            raise ValueError(f"ckpt_step ({self.ckpt_step}) needs load and must be >= 0")
        if self.save_interval is not None and not self.save:
            raise ValueError("save_interval is set but save (the checkpoint directory) is not")
        if (self.ref_load or self.ref_update_interval) and not (self.use_kl_loss or self.kl_coef):
            raise ValueError("ref_load and ref_update_interval need a reference model (use_kl_loss or kl_coef)")
        if self.debug_rollout_only and (self.debug_train_only or self.load_debug_rollout_data):
            raise ValueError("debug_rollout_only excludes debug_train_only and load_debug_rollout_data")
        if self.debug_train_only and not self.load_debug_rollout_data:
            raise ValueError("debug_train_only needs load_debug_rollout_data (there are no engines to generate with)")
        for name in ("save_debug_rollout_data", "load_debug_rollout_data", "save_hf"):
            try:
                getattr(self, name).format(rollout_id=0)
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(f"{name}: bad pattern {getattr(self, name)!r} (only {{rollout_id}} is filled in: "
                                 f"{err})") from None
        return self

    @property
    def train_only(self) -> bool:
        """No engines, manager or buffer: rollouts come from load_debug_rollout_data."""
        return self.debug_train_only or bool(self.load_debug_rollout_data)

    # Generation features (issue 5): over-sampling, dynamic filter, partial rollout, custom generate, group reward
    # and eval (slime's flags; reference/slime.md §3). The rollout manager loads the plugins when a rollout starts.
    over_sampling_batch_size: int | None = None  # groups leased per refill, >= rollout_batch_size (unset: the missing)
    dynamic_sampling_filter_path: str = ""  # fn(args, samples) -> DynamicFilterOutput | bool, or a built-in's name
    partial_rollout: bool = False  # groups aborted once the batch is full keep their tokens for the next rollout
    mask_offpolicy_in_partial_rollout: bool = False  # an earlier rollout's tokens get loss_mask 0
    custom_generate_function_path: str = ""  # async def generate(args, sample, sampling_params) -> Sample
    group_rm: bool = False  # custom_rm_path is async def f(args, samples) -> list[float], called once per group
    eval_prompt_data: list[str] = []  # "name=path" entries (slime's "name path ..." pairs are accepted)
    eval_interval: int | None = None  # eval every N rollouts and after the last one
    n_samples_per_eval_prompt: int = 1
    eval_temperature: float | None = None  # None: rollout_temperature
    eval_top_p: float | None = None  # None: rollout_top_p
    eval_max_response_len: int | None = None  # None: rollout_max_response_len

    @field_validator("eval_prompt_data")
    @classmethod
    def _eval_name_path_pairs(cls, value: list[str]) -> list[str]:
        """"name=path" entries; slime's `name path name path`; a lone path is named after its file."""
        if all("=" in entry for entry in value):
            return value
        if len(value) == 1:
            return [f"{value[0].rsplit('/', 1)[-1].split('.')[0]}={value[0]}"]
        if len(value) % 2 or any("=" in entry for entry in value):
            raise ValueError(f"eval_prompt_data: expected name=path entries or name path pairs, got {value}")
        return [f"{name}={path}" for name, path in zip(value[::2], value[1::2], strict=True)]

    @model_validator(mode="after")
    def _check_generation(self) -> JobSpec:
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.rollout_batch_size:
            raise ValueError(f"over_sampling_batch_size ({self.over_sampling_batch_size}) must be >= "
                             f"rollout_batch_size ({self.rollout_batch_size})")
        for name in ("eval_interval", "n_samples_per_eval_prompt", "eval_max_response_len", "eval_temperature"):
            value = getattr(self, name)
            if value is not None and (value < 0 if name == "eval_temperature" else value <= 0):
                raise ValueError(f"{name} must be {'>= 0' if name == 'eval_temperature' else '> 0'}, got {value}")
        if self.eval_top_p is not None and not 0 < self.eval_top_p <= 1:
            raise ValueError(f"eval_top_p must be in (0, 1], got {self.eval_top_p}")
        names = [entry.split("=", 1)[0] for entry in self.eval_prompt_data]
        for name in names:
            if not name or not all(c.isalnum() or c in "_-." for c in name) or names.count(name) > 1:
                raise ValueError(f"eval_prompt_data: dataset names must be unique and made of letters, digits, "
                                 f"'_', '-' and '.', got {names}")
        if self.eval_interval is not None and not self.eval_prompt_data:
            raise ValueError("eval_interval is set but eval_prompt_data is empty")
        if self.group_rm and not self.custom_rm_path:
            raise ValueError("group_rm needs custom_rm_path (async def f(args, samples) -> list[float])")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ValueError("mask_offpolicy_in_partial_rollout needs partial_rollout")
        return self


    # Megatron (issue 4): the parallel layout of train_backend megatron; other Megatron flags pass through unchanged.
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    use_distributed_optimizer: bool = True
    megatron: dict[str, Any] = {}  # extra TransformerConfig/optimizer flags by Megatron's names (slime passes them on)

    @model_validator(mode="after")
    def _check_megatron(self) -> JobSpec:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.train_backend != "megatron" and (parallel > 1 or self.megatron):
            raise ValueError("tensor_model_parallel_size, pipeline_model_parallel_size and megatron need "
                             "train_backend: megatron")
        if self.train_backend == "megatron" and self.advantage_estimator == "ppo":
            raise ValueError("advantage_estimator ppo trains a critic, which train_backend megatron does not; set "
                             "train_backend: fsdp")
        return self


    # Asynchronous training (issue 7): sync (slime's train.py), one_step_async (train_async.py: rollout i+1 generates
    # while rollout i trains) or fully_async (the manager streams groups across rollouts; stale ones are refused).
    mode: Literal["sync", "one_step_async", "fully_async"] = "sync"
    update_weights_interval: int = 1  # push weights to the engines every N rollouts (async modes)
    max_weight_staleness: int = 1  # fully_async: a trained token's policy is at most this many versions old
    stale_policy: Literal["regenerate", "drop"] = "regenerate"  # a too-stale group: regenerated, or dropped
    max_inflight_groups: int | None = None  # fully_async: groups generating or waiting (default rollout_batch_size)

    @model_validator(mode="after")
    def _check_async(self) -> JobSpec:
        if self.update_weights_interval <= 0 or self.max_weight_staleness < 0:
            raise ValueError(f"update_weights_interval must be > 0 and max_weight_staleness >= 0, got "
                             f"{self.update_weights_interval} and {self.max_weight_staleness}")
        if self.max_inflight_groups is not None and self.max_inflight_groups < self.rollout_batch_size:
            raise ValueError(f"max_inflight_groups ({self.max_inflight_groups}) must be >= rollout_batch_size "
                             f"({self.rollout_batch_size})")
        if self.mode == "fully_async":
            if self.partial_rollout or self.over_sampling_batch_size:
                raise ValueError("mode fully_async streams groups without batch boundaries: partial_rollout and "
                                 "over_sampling_batch_size do not apply")
            if self.update_weights_interval - 1 > self.max_weight_staleness:
                raise ValueError(f"mode fully_async: update_weights_interval {self.update_weights_interval} leaves "
                                 f"the engines more than max_weight_staleness ({self.max_weight_staleness}) "
                                 "versions behind")
        if self.mode != "sync" and (self.debug_rollout_only or self.train_only):
            raise ValueError(f"mode {self.mode} needs engines and a trainer: not with debug_rollout_only, "
                             "debug_train_only or load_debug_rollout_data")
        return self


def _unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, JobSpec.model_fields, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"job spec: unknown key '{key}'{hint}"


def parse_spec(data: dict[str, Any]) -> JobSpec:
    """Validate a spec dict; raise InvalidArgument naming the offending field."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"job spec: expected a mapping of slime flag names to values, got {type(data).__name__}")
    unknown = [k for k in data if k not in JobSpec.model_fields]
    if unknown:
        raise InvalidArgument("; ".join(_unknown_key_message(k) for k in unknown))
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as err:
        reasons = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"])
            reasons.append(f"{where}: {e['msg']}" if where else e["msg"].removeprefix("Value error, "))
        raise InvalidArgument("job spec: " + "; ".join(reasons)) from None
    if not spec.job_id:
        spec = spec.model_copy(update={"job_id": f"job-{uuid.uuid4().hex[:8]}"})
    return spec


def slime_args_to_dict(argv: list[str]) -> dict[str, Any]:
    """`--rollout-batch-size 8 --use-kl-loss` -> {"rollout_batch_size": "8", "use_kl_loss": True}.

    Values stay strings; pydantic converts them to each field's type.
    """
    spec: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        if not flag.startswith("--"):
            raise InvalidArgument(f"slime arguments: expected a --flag, got {flag!r}")
        key = flag[2:].replace("-", "_")
        values = []
        while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values.append(argv[i + 1])
            i += 1
        field = JobSpec.model_fields.get(key)
        is_list = field is not None and "list" in str(field.annotation)
        spec[key] = True if not values else values if is_list or len(values) > 1 else values[0]
        i += 1
    return spec
