"""Cut the job spec into the typed sub-configs each part takes: the manager's and the backend's."""

from __future__ import annotations

from services.rollout.client import RolloutConfig
from services.trainer.spec import JobSpec


def rollout_config(spec: JobSpec) -> RolloutConfig:
    return RolloutConfig(
        job_id=spec.job_id, tokenizer_path=spec.hf_checkpoint, rollout_batch_size=spec.rollout_batch_size,
        n_samples_per_prompt=spec.n_samples_per_prompt, rollout_temperature=spec.rollout_temperature,
        rollout_top_p=spec.rollout_top_p, rollout_top_k=spec.rollout_top_k,
        rollout_max_response_len=spec.rollout_max_response_len, rollout_stop=list(spec.rollout_stop),
        rollout_stop_token_ids=list(spec.rollout_stop_token_ids), rm_type=spec.rm_type,
        custom_rm_path=spec.custom_rm_path, reward_key=spec.reward_key, reward_timeout_s=spec.reward_timeout_s,
        loss_type=spec.loss_type, lease_timeout_s=spec.lease_timeout_s, args=spec.model_dump())


def train_config(spec: JobSpec):
    from services.trainer.backends.base import TrainConfig

    return TrainConfig(
        loss_type=spec.loss_type, advantage_estimator=spec.advantage_estimator,
        n_samples_per_prompt=spec.n_samples_per_prompt, global_batch_size=spec.resolved_global_batch_size,
        micro_batch_size=spec.micro_batch_size, rollout_temperature=spec.rollout_temperature,
        eps_clip=spec.eps_clip, eps_clip_high=spec.eps_clip_high, use_kl_loss=spec.use_kl_loss,
        kl_loss_coef=spec.kl_loss_coef, kl_loss_type=spec.kl_loss_type, entropy_coef=spec.entropy_coef,
        disable_grpo_std_normalization=spec.disable_grpo_std_normalization,
        disable_rewards_normalization=spec.disable_rewards_normalization,
        calculate_per_token_loss=spec.calculate_per_token_loss, lr=spec.lr, weight_decay=spec.weight_decay,
        adam_beta1=spec.adam_beta1, adam_beta2=spec.adam_beta2, clip_grad=spec.clip_grad, seed=spec.seed)
