"""The RL step every backend shares: a rollout's advantages and returns, and a micro-batch's loss from its forward.

A backend runs the models (policy log-probs and entropy, critic values, logits) and the optimizer; everything from
those tensors to the loss (slime's `compute_advantages_and_returns`, `loss_function` and its reducers) is here, once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from services.common.samples import Sample
from services.trainer.algorithms.advantages import (
    get_advantage_estimator,
    normalize_advantages,
    opd_advantages,
    post_process_rewards,
)
from services.trainer.algorithms.kl import compute_approx_kl
from services.trainer.algorithms.losses import (
    Reducer,
    policy_loss_function,
    sft_loss_function,
    sum_of_sample_mean,
    sum_of_token,
    token_log_probs_and_entropy,
    value_loss_function,
)
from services.trainer.batching.batch import RolloutBatch
from services.trainer.batching.packing import gather_response, is_packed, response_valid, scatter_response
from services.trainer.settings.train import TrainConfig
from services.trainer.step import hooks

LossFn = Callable[[RolloutBatch, Reducer], tuple[torch.Tensor, dict[str, torch.Tensor]]]
# (logits, micro-batch, *, with_entropy) -> response-aligned (log_probs, entropy or None) [b, R]
TokenStats = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def needs_old_log_probs(config: TrainConfig, num_steps: int) -> bool:
    """Whether the old policy's log-probs must be recomputed before training. Not for SFT, nor under
    use_rollout_logprobs (the engines' log-probs are the old policy), nor when slime's `can_reuse_log_probs_in_loss`
    holds: one step per rollout, a policy loss, no KL reward, no critic, no GSPO, no use_routing_replay of the
    trainer's own routing (that forward records it), no on-policy distillation; then the loss reuses its own
    forward's log-probs, detached, and ppo_kl is exactly 0."""
    if config.loss_type == "sft_loss" or config.use_rollout_logprobs:
        return False
    records_routing = config.use_routing_replay and not config.use_rollout_routing_replay  # the forward to replay
    return not (num_steps == 1 and config.loss_type == "policy_loss" and config.kl_coef == 0
                and not config.use_critic and config.advantage_estimator != "gspo" and not records_routing
                and not config.use_opd)


def with_advantages(batch: RolloutBatch, config: TrainConfig, *, num_steps: int,
                    log_probs_of: Callable[[torch.nn.Module], torch.Tensor], model: torch.nn.Module,
                    ref_model: torch.nn.Module | None, samples: Sequence[Sample],
                    teacher_model: torch.nn.Module | None = None,
                    group: dist.ProcessGroup | None = None) -> RolloutBatch:
    """slime's steps before training a rollout's policy: the old policy's log-probs where the loss needs them
    (`needs_old_log_probs`), the reference model's when there is one, the distillation teacher's when the trainer
    runs one, then advantages and returns. `log_probs_of(model)` is the backend's [B, R] log-probs of the batch
    under `model`, without grad, in its training micro-batches; `group`: the data-parallel ranks whose rows the
    advantages are whitened over."""
    if needs_old_log_probs(config, num_steps):
        batch = batch.with_(log_probs=log_probs_of(model))
    if ref_model is not None:
        batch = batch.with_(ref_log_probs=log_probs_of(ref_model))
    if teacher_model is not None:
        batch = batch.with_(teacher_log_probs=log_probs_of(teacher_model))
    return compute_advantages_and_returns(batch, config, group=group, samples=samples)


def processed_rewards(batch: RolloutBatch, config: TrainConfig, samples: Sequence[Sample] | None) -> torch.Tensor:
    """slime's `_post_process_rewards`: the custom_reward_post_process_path hook on the batch's samples, else the
    group baseline the estimator calls for. [B]."""
    if config.custom_reward_post_process_path:
        if samples is None:
            raise ValueError("custom_reward_post_process_path needs the rollout's samples")
        return hooks.post_process_rewards(config, samples, batch.rewards.device)
    return post_process_rewards(
        batch.rewards, advantage_estimator=config.advantage_estimator, n_samples_per_prompt=config.n_samples_per_prompt,
        rewards_normalization=not config.disable_rewards_normalization,
        grpo_std_normalization=not config.disable_grpo_std_normalization,
        group_ids=fanned_out_groups(samples, config.n_samples_per_prompt))


def fanned_out_groups(samples: Sequence[Sample] | None, n_samples_per_prompt: int) -> list[int] | None:
    """Each row's group (an ordinal) when some prompt's group is not n_samples_per_prompt rows (a generate function
    or an agent fanned out into several trajectories): its baseline is then over its own rows, not over rows cut
    every n. None when every group has n rows (slime's reshape is the same).

    A group is a run of consecutive rows with one group_index (a buffer group's rows are consecutive in the rollout),
    so one prompt answered in two epochs of one rollout stays two groups. Rows that carry no grouping at all (every
    group_index and index 0: samples built by hand) are cut every n, as slime does."""
    if not samples or all(sample.group_index == 0 and sample.index == 0 for sample in samples):
        return None
    ids, sizes = [], []
    for position, sample in enumerate(samples):
        if position == 0 or sample.group_index != samples[position - 1].group_index:
            sizes.append(0)
        sizes[-1] += 1
        ids.append(len(sizes) - 1)
    if all(size == n_samples_per_prompt for size in sizes):
        return None
    return ids


def compute_advantages_and_returns(batch: RolloutBatch, config: TrainConfig, *,
                                   group: dist.ProcessGroup | None = None,
                                   samples: Sequence[Sample] | None = None) -> RolloutBatch:
    """slime's `compute_advantages_and_returns`: post-process rewards, KL for reward shaping, the estimator (or
    custom_advantage_function_path), then (normalize_advantages) masked whitening with statistics all-reduced over
    `group` (data-parallel ranks).

    Reads batch.log_probs (or rollout_log_probs under use_rollout_logprobs) and batch.ref_log_probs when
    kl_coef != 0, batch.values for ppo; `samples` (the batch's rows) for a reward post-process hook. Returns the
    batch with advantages and returns set.
    """
    rewards = processed_rewards(batch, config, samples)
    if config.kl_coef != 0:
        old = batch.rollout_log_probs if config.use_rollout_logprobs else batch.log_probs
        if old is None or batch.ref_log_probs is None:
            raise ValueError("kl_coef != 0 needs the old and the reference log-probs of the rollout")
        kl = compute_approx_kl(old, batch.ref_log_probs, kl_loss_type=config.kl_loss_type)
    else:
        kl = torch.zeros_like(batch.loss_masks)
    if config.custom_advantage_function_path:
        advantages, returns = hooks.custom_advantages(config, batch, rewards=rewards, kl=kl)
    else:
        advantages, returns = get_advantage_estimator(config.advantage_estimator)(
            rewards, kl=kl, loss_mask=batch.loss_masks, response_lengths=batch.response_lengths, values=batch.values,
            kl_coef=config.kl_coef, gamma=config.gamma, lambd=config.lambd)
    if config.use_opd:
        advantages, _ = opd_advantages(advantages, student_log_probs=_student_log_probs(batch, config),
                                       teacher_log_probs=_teacher_log_probs(batch, config), loss_mask=batch.loss_masks,
                                       opd_kl_coef=config.opd_kl_coef)
    if config.normalize_advantages:
        advantages = normalize_advantages(advantages, batch.loss_masks, group=group)
    return batch.with_(advantages=advantages, returns=returns)


def _student_log_probs(batch: RolloutBatch, config: TrainConfig) -> torch.Tensor:
    """The policy's log-probs that on-policy distillation compares with the teacher's (slime: the old policy's, or
    the engines' under use_rollout_logprobs)."""
    student = batch.rollout_log_probs if config.use_rollout_logprobs else batch.log_probs
    if student is None:
        raise ValueError("use_opd needs the policy's log-probs of the rollout (recomputed, or the engines' under "
                         "use_rollout_logprobs)")
    return student


def _teacher_log_probs(batch: RolloutBatch, config: TrainConfig) -> torch.Tensor:
    if batch.teacher_log_probs is None:
        source = "the teacher model's forward" if config.opd_type == "megatron" else \
            "the samples' teacher_log_probs (set by the rollout service from opd_teacher_url)"
        raise ValueError(f"use_opd with opd_type {config.opd_type!r} needs teacher log-probs for every response "
                         f"token, from {source}; some sample has none")
    return batch.teacher_log_probs


def critic_returns(batch: RolloutBatch, config: TrainConfig, samples: Sequence[Sample] | None = None) -> torch.Tensor:
    """The critic's value targets: the estimator's returns without KL reward shaping, as slime's critic computes
    them from rollout data that holds no policy log-probs. [B, R]."""
    rewards = processed_rewards(batch, config, samples)
    _, returns = get_advantage_estimator(config.advantage_estimator)(
        rewards, kl=torch.zeros_like(batch.loss_masks), loss_mask=batch.loss_masks,
        response_lengths=batch.response_lengths, values=batch.values, kl_coef=0.0, gamma=config.gamma,
        lambd=config.lambd)
    return returns


def step_normalizer(config: TrainConfig, mask_sums: torch.Tensor) -> float:
    """What a step's reduced sums are divided by: its sample count (mean of per-sample means), or under
    calculate_per_token_loss its token count Σ max(mask_sum, 1). mask_sums: [n] over all the step's samples."""
    if config.calculate_per_token_loss:
        return float(mask_sums.clamp_min(1).sum())
    return float(mask_sums.numel())


def make_reducer(config: TrainConfig, loss_mask: torch.Tensor, denominators: torch.Tensor,
                 normalizer: float) -> Reducer:
    """A micro-batch's reducer: [b, R] per-token values -> its share of the step's scalar (slime's
    `get_sum_of_sample_mean`). denominators: [b] each sample's rollout mask total, fixed for the step."""
    if config.calculate_per_token_loss:
        return lambda x: sum_of_token(x, loss_mask) / normalizer
    return lambda x: sum_of_sample_mean(x, loss_mask, denominators=denominators) / normalizer


def response_log_probs(logits: torch.Tensor, mb: RolloutBatch, config: TrainConfig, *,
                       with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Padded [b, L, V] or packed [1, T, V] logits -> response-aligned (log_probs, entropy) [b, R] at the rollout
    temperature."""
    return token_log_probs_and_entropy(gather_response(logits, mb), mb.response_tokens,
                                       temperature=config.rollout_temperature, with_entropy=with_entropy,
                                       entropy_grad=config.entropy_coef != 0)


def response_row_log_probs(rows: torch.Tensor, mb: RolloutBatch, config: TrainConfig, *,
                           with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits of the response tokens alone, [N, V] in `packing.response_mask`'s order, -> response-aligned
    (log_probs, entropy) [b, R] at the rollout temperature, zero on padding columns."""
    log_probs, entropy = token_log_probs_and_entropy(rows, mb.response_tokens[response_valid(mb)],
                                                     temperature=config.rollout_temperature, with_entropy=with_entropy,
                                                     entropy_grad=config.entropy_coef != 0)
    return scatter_response(log_probs, mb), None if entropy is None else scatter_response(entropy, mb)


def policy_loss(config: TrainConfig, mb: RolloutBatch, *, log_probs: torch.Tensor, entropy: torch.Tensor,
                reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's `policy_loss_function` on a micro-batch whose advantages (and old / reference log-probs) are set."""
    loss, metrics = policy_loss_function(
        log_probs=log_probs, entropy=entropy, advantages=mb.advantages, loss_mask=mb.loss_masks, reduce=reduce,
        old_log_probs=mb.rollout_log_probs if config.use_rollout_logprobs else mb.log_probs,
        train_log_probs=mb.log_probs, rollout_log_probs=mb.rollout_log_probs,
        ref_log_probs=mb.ref_log_probs if config.use_kl_loss else None,
        advantage_estimator=config.advantage_estimator, eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high,
        eps_clip_c=config.eps_clip_c, entropy_coef=config.entropy_coef, kl_loss_coef=config.kl_loss_coef,
        kl_loss_type=config.kl_loss_type, use_unbiased_kl=config.use_unbiased_kl,
        use_rollout_logprobs=config.use_rollout_logprobs, use_tis=config.use_tis, tis_clip=config.tis_clip,
        tis_clip_low=config.tis_clip_low, tis_function=custom_tis(config, mb))
    if config.use_opd and mb.teacher_log_probs is not None:  # slime's train/opd_reverse_kl, reduced as the loss is
        student = mb.rollout_log_probs if config.use_rollout_logprobs else mb.log_probs
        student = log_probs if student is None else student
        metrics["opd_reverse_kl"] = reduce((student.detach() - mb.teacher_log_probs) * mb.loss_masks)
    return loss, metrics


def custom_tis(config: TrainConfig, mb: RolloutBatch) -> hooks.TisFunction | None:
    """custom_tis_function_path's function for this micro-batch, when slime would call it: under use_tis, or under
    get_mismatch_metrics (a mapped flag, in the job's args) for the function's metrics alone."""
    if config.custom_tis_function_path and (config.use_tis or config.args.get("get_mismatch_metrics")):
        return hooks.tis_function(config, mb)
    return None


def value_loss(config: TrainConfig, mb: RolloutBatch, *, values: torch.Tensor,
               reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's clipped value loss against mb.returns, around the values it predicted before training."""
    return value_loss_function(values=values, old_values=mb.values, returns=mb.returns, reduce=reduce,
                               value_clip=config.value_clip)


def sft_loss(mb: RolloutBatch, *, log_probs: torch.Tensor, reduce: Reducer) -> tuple[torch.Tensor, dict]:
    return sft_loss_function(log_probs=log_probs, reduce=reduce)


def custom_loss(fn: Callable, config: TrainConfig, mb: RolloutBatch, *, logits: torch.Tensor,
                reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call a user loss with slime's signature fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics).

    As in slime, `logits` are the raw packed logits [1, Σ L_i, V] (samples back to back, no temperature) and
    `batch` holds per-sample lists: unconcat_tokens, total_lengths, response_lengths, loss_masks, advantages,
    returns, raw_reward and, when computed, log_probs, ref_log_probs, rollout_log_probs, values. The reducer takes
    slime's packed response tokens [Σ R_i] (or padded [b, R]). args: slime's, the job's flags with the TrainConfig
    fields over them.
    """
    lengths = mb.response_lengths.tolist()
    total = (mb.prompt_lengths + mb.response_lengths).tolist()
    batch = {"unconcat_tokens": [mb.tokens[i, :n] for i, n in enumerate(total)], "total_lengths": total,
             "response_lengths": lengths, "raw_reward": mb.rewards.tolist()}
    for key in ("loss_masks", "advantages", "returns", "log_probs", "ref_log_probs", "rollout_log_probs", "values"):
        value = getattr(mb, key)
        if value is not None:
            batch[key] = [value[i, :n] for i, n in enumerate(lengths)]
    valid = (torch.arange(mb.loss_masks.shape[1], device=mb.loss_masks.device)
             < mb.response_lengths.to(mb.loss_masks.device).unsqueeze(-1))

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:  # slime's packed response tokens
            x = x.new_zeros(mb.loss_masks.shape).index_put((valid.nonzero(as_tuple=True)), x)
        return reduce(x)

    packed = logits if is_packed(logits, mb) else logits[mb.attention_mask.bool()].unsqueeze(0)
    loss, metrics = fn(hooks.slime_args(config), batch, packed, sum_of_sample_mean)
    return loss, {"loss": loss.detach(), **{k: torch.as_tensor(v).detach() for k, v in metrics.items()}}


def micro_batch_loss(config: TrainConfig, mb: RolloutBatch, *, logits: torch.Tensor, reduce: Reducer,
                     custom_loss_fn: Callable | None = None, token_stats: TokenStats | None = None,
                     full_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss on a micro-batch from its raw logits (padded [b, L, V] or packed [1, T, V]), by loss_type
    (slime's `loss_function`). A backend whose logits are sharded gives how it reads log-probs from them
    (`token_stats`, default `response_log_probs`) and how it gathers the whole vocabulary for a custom loss
    (`full_logits`)."""
    if config.loss_type == "custom_loss":
        full = full_logits(logits) if full_logits is not None else logits
        return custom_loss(custom_loss_fn, config, mb, logits=full, reduce=reduce)
    if token_stats is None:
        def token_stats(logits: torch.Tensor, mb: RolloutBatch, *, with_entropy: bool):
            return response_log_probs(logits, mb, config, with_entropy=with_entropy)
    log_probs, entropy = token_stats(logits, mb, with_entropy=config.loss_type == "policy_loss")
    return log_prob_loss(config, mb, log_probs=log_probs, entropy=entropy, reduce=reduce)


def log_prob_loss(config: TrainConfig, mb: RolloutBatch, *, log_probs: torch.Tensor, entropy: torch.Tensor | None,
                  reduce: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's policy or SFT loss from its response-aligned log-probs and entropy [b, R] (the entropy: under
    policy_loss)."""
    if config.loss_type == "sft_loss":
        return sft_loss(mb, log_probs=log_probs, reduce=reduce)
    return policy_loss(config, mb, log_probs=log_probs, entropy=entropy, reduce=reduce)
