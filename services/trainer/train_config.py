"""Cut the job spec into the typed sub-configs each part takes: the manager's and the backend's."""

from __future__ import annotations

import dataclasses

from services.rollout.client import RolloutConfig
from services.trainer.slime_flags import slime_defaults
from services.trainer.spec import JobSpec


def rollout_config(spec: JobSpec) -> RolloutConfig:
    return RolloutConfig(
        job_id=spec.job_id, tokenizer_path=spec.hf_checkpoint, rollout_batch_size=spec.rollout_batch_size,
        n_samples_per_prompt=spec.n_samples_per_prompt, rollout_temperature=spec.rollout_temperature,
        rollout_top_p=spec.rollout_top_p, rollout_top_k=spec.rollout_top_k,
        rollout_max_response_len=spec.rollout_max_response_len, rollout_stop=list(spec.rollout_stop),
        rollout_stop_token_ids=list(spec.rollout_stop_token_ids), rm_type=spec.rm_type,
        custom_rm_path=spec.custom_rm_path, reward_key=spec.reward_key, reward_timeout_s=spec.reward_timeout_s,
        loss_type=spec.loss_type, lease_timeout_s=spec.lease_timeout_s, args=plugin_args(spec),
        **generation_features(spec))


def plugin_args(spec: JobSpec) -> dict:
    """slime's `args` for plugins: slime's default for every flag, the spec's plugin_args, then the spec itself."""
    spec_values = spec.model_dump(exclude={"plugin_args", "slime_notes"})
    return {**slime_defaults(), **spec.plugin_args, **spec_values}


def generation_features(spec: JobSpec) -> dict:
    """The RolloutConfig fields of issue 5 (eval sampling falls back to the rollout's)."""
    return dict(
        over_sampling_batch_size=spec.over_sampling_batch_size or 0,
        dynamic_sampling_filter_path=spec.dynamic_sampling_filter_path, partial_rollout=spec.partial_rollout,
        mask_offpolicy_in_partial_rollout=spec.mask_offpolicy_in_partial_rollout,
        custom_generate_function_path=spec.custom_generate_function_path, group_rm=spec.group_rm,
        eval_prompt_data=list(spec.eval_prompt_data), n_samples_per_eval_prompt=spec.n_samples_per_eval_prompt,
        eval_temperature=spec.rollout_temperature if spec.eval_temperature is None else spec.eval_temperature,
        eval_top_p=spec.rollout_top_p if spec.eval_top_p is None else spec.eval_top_p,
        eval_max_response_len=spec.eval_max_response_len or spec.rollout_max_response_len,
        input_key=spec.input_key, label_key=spec.label_key, metadata_key=spec.metadata_key,
        apply_chat_template=spec.apply_chat_template,
        max_inflight_groups=(spec.max_inflight_groups or spec.rollout_batch_size) if spec.mode == "fully_async" else 0)


def train_config(spec: JobSpec):
    """The backend's TrainConfig: every TrainConfig field is a spec key of the same name; lr_decay_iters defaults
    to the run's last optimizer step, as slime sets it from num_rollout."""
    from services.trainer.backends.base import TrainConfig

    keys = type(spec).model_fields
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(TrainConfig) if f.name in keys}
    values["global_batch_size"] = spec.resolved_global_batch_size
    if spec.lr_decay_iters is None:
        values["lr_decay_iters"] = spec.train_iters
    return TrainConfig(**values)
