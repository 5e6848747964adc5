"""The job spec: user input keyed by slime's flag names in snake_case, validated with pydantic.

Unknown keys are rejected by name (with a suggestion); a slime-style argument list converts to the same keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
import uuid
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from services.common import bounds
from services.common.config import own_settings, settings
from services.common.errors import InvalidArgument
from services.common.settings.rollout import RolloutConfig
from services.trainer.backends.capabilities import backends_that
from services.trainer.backends.layout import CUSTOM_LOSS_REFUSAL, LayoutConfig
from services.trainer.settings.driver import DriverConfig
from services.trainer.settings.slime import SlimeConfig
from services.trainer.settings.train import TrainConfig
from services.trainer.settings.weight_sync import SyncConfig
from services.trainer.slime_flags import args as slime_args

# The parts a job configures, in the order the README lists them. Every job-spec key is a setting declared by one of
# them (a part reusing another's declaration, like TrainConfig's n_samples_per_prompt, adds no key).
PARTS: tuple[type, ...] = (DriverConfig, RolloutConfig, TrainConfig, LayoutConfig, SyncConfig, SlimeConfig)


def _declared_settings() -> dict[str, tuple[Any, Any]]:
    """pydantic field definitions of every part's own settings, with their defaults and help."""
    out: dict[str, tuple[Any, Any]] = {}
    for part in PARTS:
        hints = typing.get_type_hints(part)
        for f in own_settings(part):
            if f.default_factory is not dataclasses.MISSING:
                spec_field = Field(default_factory=f.default_factory, description=f.metadata["help"])
            elif f.default is dataclasses.MISSING:
                spec_field = Field(description=f.metadata["help"])
            else:
                spec_field = Field(f.default, description=f.metadata["help"])
            out[f.name] = (hints[f.name], spec_field)
    return out


# allow_inf_nan=False: NaN and Infinity would pass every range check (`<=` is false both ways)
_JobSettings = create_model("JobSettings", __config__=ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False),
                            **_declared_settings())


class JobSpec(_JobSettings):
    """A job: its settings as one flat mapping keyed by slime's flags (what users write and plugins see as `args`),
    cut into the parts' typed configs (`driver`, `rollout`, `train`, `layout`, `sync`). Each part validates its own
    settings; the rules that span parts are here."""

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
    def _check(self) -> JobSpec:
        bounds.int64_fields(self)  # a bigger int breaks proto and JSON later (job listing, events)
        if self.job_id:
            bounds.job_id(self.job_id)
        for name in ("global_batch_size", "num_steps_per_rollout"):  # divisors below, before TrainConfig checks them
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        # Each part validates its own settings; the rollout's as the user set them (before the mode resolves any).
        rollout = RolloutConfig(**self._values(RolloutConfig), job_id=self.job_id or "unnamed")
        driver, layout, _ = self.driver, self.layout, self.sync
        samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
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
        train = self.train
        if (driver.ref_load or driver.ref_update_interval) and not train.needs_ref_model:
            raise ValueError("ref_load and ref_update_interval need a reference model (use_kl_loss or kl_coef)")
        _check_distillation(train, rollout, driver)
        names = list(rollout.eval_datasets)
        if len(names) < len(rollout.eval_prompt_data) or not all(
                name and all(c.isalnum() or c in "_-." for c in name) for name in names):
            raise ValueError(f"eval_prompt_data: dataset names must be unique and made of letters, digits, "
                             f"'_', '-' and '.', got {[e.split('=', 1)[0] for e in rollout.eval_prompt_data]}")
        if driver.eval_interval is not None and not rollout.eval_prompt_data:
            raise ValueError("eval_interval is set but eval_prompt_data is empty")
        if driver.streams and (rollout.partial_rollout or rollout.over_sampling_batch_size):
            raise ValueError("mode fully_async streams groups without batch boundaries: partial_rollout and "
                             "over_sampling_batch_size do not apply")
        if layout.context_parallel_size > 1 and train.loss_type == "custom_loss":
            raise ValueError(CUSTOM_LOSS_REFUSAL)
        if train.use_critic and not layout.capabilities.critic:
            able = " or ".join(backends_that(lambda caps: caps.critic))
            raise ValueError(f"advantage_estimator ppo trains a critic, which train_backend {layout.train_backend} "
                             f"does not; set train_backend: {able}")
        if train.mtp_num_layers and not layout.capabilities.mtp:
            able = " or ".join(backends_that(lambda caps: caps.mtp))
            raise ValueError(f"mtp_num_layers: train_backend {layout.train_backend} builds no multi-token-prediction "
                             f"layers; set train_backend: {able}")
        if rollout.multimodal_keys and not layout.capabilities.vision:
            able = " or ".join(backends_that(lambda caps: caps.vision))
            raise ValueError(f"multimodal_keys: train_backend {layout.train_backend} does not take images in its "
                             f"forward; set train_backend: {able}")
        if rollout.multimodal_keys and train.mtp_num_layers:  # megatron-core's MTP layers embed every token as text
            raise ValueError("multimodal_keys: the multi-token-prediction layers (mtp_num_layers) take text rows "
                             "only; drop mtp_num_layers to train on images")
        if rollout.multimodal_keys and (layout.context_parallel_size > 1 or train.use_critic):
            raise ValueError("multimodal_keys: a forward with images runs whole on one rank and without a critic; "
                             "use context_parallel_size 1 and an advantage_estimator other than ppo")
        if rollout.multimodal_keys and (driver.save_debug_rollout_data or driver.load_debug_rollout_data):
            raise ValueError("multimodal_keys: rollout dumps (save_debug_rollout_data, load_debug_rollout_data) hold "
                             "samples without their groups' images")
        _check_lora(train, layout, driver, self.sync)
        if train.freeze_vision and not rollout.multimodal_keys:
            raise ValueError("freeze_vision needs multimodal_keys (a job without images trains the language model)")
        return self

    def _values(self, part: type) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in settings(part)}

    @property
    def driver(self) -> DriverConfig:
        return DriverConfig(**self._values(DriverConfig))

    @property
    def layout(self) -> LayoutConfig:
        return LayoutConfig(**self._values(LayoutConfig))

    @property
    def sync(self) -> SyncConfig:
        return SyncConfig(**self._values(SyncConfig))

    @property
    def rollout(self) -> RolloutConfig:
        """What the manager runs with: the whole spec as the plugins' `args`; a stream bound only in fully_async."""
        stream = (self.max_inflight_groups or self.rollout_batch_size) if self.driver.streams else 0
        return RolloutConfig(**{**self._values(RolloutConfig), "max_inflight_groups": stream}, job_id=self.job_id,
                             tokenizer_path=self.hf_checkpoint, args=self.plugin_args_view())

    def plugin_args_view(self) -> dict[str, Any]:
        """slime's `args`: slime's default for every flag, the spec's plugin_args, then the spec's own keys."""
        own = self.model_dump(exclude={"plugin_args", "slime_notes", "slime_sources"})
        return {**slime_args.slime_defaults(), **self.plugin_args, **own}

    @property
    def train(self) -> TrainConfig:
        """The backend's settings; global_batch_size and lr_decay_iters resolved as slime resolves them."""
        return TrainConfig(**{**self._values(TrainConfig), "args": self.plugin_args_view(),
                              "global_batch_size": self.resolved_global_batch_size,
                              "lr_decay_iters": self.train_iters if self.lr_decay_iters is None
                              else self.lr_decay_iters})

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

    @property
    def train_only(self) -> bool:
        return self.driver.train_only


def _check_lora(train: TrainConfig, layout: LayoutConfig, driver: DriverConfig, sync: SyncConfig) -> None:
    """LoRA trains on a backend with adapter layers; its KL reference is the base model itself; its adapter syncs
    whole, by lora_sync."""
    if not train.lora:
        return
    if sync.weight_sync_backend == "disk" or sync.update_weight_mode == "delta":
        raise ValueError("lora_rank: the adapter (a few MB) syncs whole over the weight-update group (gloo, nccl or "
                         "auto), or as a PEFT directory per version (lora_sync disk); weight_sync_backend disk and "
                         "update_weight_mode delta do not apply")
    if not layout.capabilities.lora:
        able = " or ".join(backends_that(lambda caps: caps.lora))
        raise ValueError(f"lora_rank: train_backend {layout.train_backend} builds megatron-core's parallel layers, "
                         f"which carry no LoRA adapters here; set train_backend: {able}")
    if driver.ref_load or driver.ref_update_interval:
        raise ValueError("lora_rank: the reference model is the base model with the adapters off; ref_load and "
                         "ref_update_interval do not apply")


def _check_distillation(train: TrainConfig, rollout: RolloutConfig, driver: DriverConfig) -> None:
    """On-policy distillation's teacher: a teacher engine (sglang) or a teacher model in the trainer (megatron)."""
    if not train.use_opd:
        if rollout.opd_teacher_url or rollout.opd_only or driver.opd_teacher_load:
            raise ValueError("opd_teacher_url, opd_only and opd_teacher_load are on-policy distillation's: they need "
                             "use_opd")
    elif train.opd_type == "sglang" and (not rollout.opd_teacher_url or driver.opd_teacher_load):
        raise ValueError("opd_type sglang takes the teacher's log-probs from a teacher engine: set opd_teacher_url "
                         "(its /generate URL), not opd_teacher_load")
    elif train.opd_type == "megatron" and (not driver.opd_teacher_load or rollout.opd_teacher_url):
        raise ValueError("opd_type megatron runs a teacher model in the trainer: set opd_teacher_load (an HF "
                         "directory or a checkpoint root), not opd_teacher_url")


def _unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, JobSpec.model_fields, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"job spec: unknown key '{key}'{hint}"


def parse_spec(data: dict[str, Any]) -> JobSpec:
    """Validate a spec dict (its `slime_args`, a slime argv, converted first); raise InvalidArgument naming the
    offending field."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"job spec: expected a mapping of slime flag names to values, got {type(data).__name__}")
    data = slime_args.apply(data, set(JobSpec.model_fields))
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
