"""The job spec: user input keyed by slime's flag names in snake_case, validated with pydantic.

Unknown keys are rejected by name (with a suggestion); a slime-style argument list converts to the same keys.
"""

from __future__ import annotations

import difflib
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from services.common.errors import InvalidArgument


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

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
    # Training.
    train_backend: Literal["fsdp"] = "fsdp"
    loss_type: Literal["policy_loss", "sft_loss"] = "policy_loss"
    advantage_estimator: Literal["grpo"] = "grpo"
    global_batch_size: int | None = None
    num_steps_per_rollout: int | None = None
    micro_batch_size: int = 1
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    entropy_coef: float = 0.0
    disable_grpo_std_normalization: bool = False
    disable_rewards_normalization: bool = False
    calculate_per_token_loss: bool = False
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
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
        for name in positive:
            if getattr(self, name) <= 0:
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
        if self.kl_loss_coef and not self.use_kl_loss:
            raise ValueError("kl_loss_coef is set but use_kl_loss is false")
        return self

    @property
    def resolved_global_batch_size(self) -> int:
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if self.global_batch_size is not None:
            return self.global_batch_size
        return samples // (self.num_steps_per_rollout or 1)


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
