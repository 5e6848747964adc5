"""slime's trainer-side hooks with slime's signatures: reward post-processing, the advantage function and the TIS
function, each loaded once by import path (under the plugin allow-list) and called with slime's `args`.

The backends hold padded [B, R] tensors; slime's hooks take per-sample lists of [R_i] tensors (and the TIS function
a flat [Σ R_i] loss), so the conversions both ways are here. The formulas stay the hooks' own.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from services.common import plugins
from services.common.plugin_sample import PluginSample
from services.common.samples import Sample
from services.trainer.batching.batch import RolloutBatch
from services.trainer.distributed import cp_responses
from services.trainer.settings.train import TrainConfig

REWARD_POST_PROCESS = "def fn(args, samples) -> (raw_rewards, rewards)"
ADVANTAGE = "def fn(args, rollout_data) -> None (sets rollout_data['advantages'] and ['returns'])"
TIS = ("def fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, "
       "**kwargs) -> (pg_loss, loss_masks, metrics)")
HOOKS = {"custom_reward_post_process_path": (REWARD_POST_PROCESS, 2),
         "custom_advantage_function_path": (ADVANTAGE, 2), "custom_tis_function_path": (TIS, 1)}


@functools.cache
def _load(flag: str, path: str) -> Callable:
    expected, num_params = HOOKS[flag]
    return plugins.load_function(path, flag=flag, expected=expected, num_params=num_params, is_async=False)


def load_all(config: TrainConfig) -> None:
    """Import every hook the config names, so a bad one fails when the backend is built, not mid-run."""
    for flag in HOOKS:
        if getattr(config, flag):
            _load(flag, getattr(config, flag))


def slime_args(config: TrainConfig) -> types.SimpleNamespace:
    """slime's `args`: the job's flags (config.args) with the backend's resolved settings over them."""
    own = {k: v for k, v in asdict(config).items() if k != "args"}
    return types.SimpleNamespace(**{**config.args, **own})


def per_sample(x: torch.Tensor | None, lengths: list[int]) -> list[torch.Tensor] | None:
    """[B, R] -> [x[i, :R_i]], slime's per-sample response tensors."""
    return None if x is None else [x[i, :n] for i, n in enumerate(lengths)]


def padded(values: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> torch.Tensor:
    """slime's per-sample [R_i] tensors back to `like`'s [B, R] (zeros past each R_i); a wrong count or length fails
    naming `what`."""
    if len(values) != like.shape[0]:
        raise ValueError(f"{what}: {len(values)} tensors for {like.shape[0]} samples")
    out = torch.zeros_like(like, dtype=torch.float32)
    for i, value in enumerate(values):
        value = torch.as_tensor(value, dtype=torch.float32, device=like.device).reshape(-1)
        if value.numel() > like.shape[1]:
            raise ValueError(f"{what}: sample {i} has {value.numel()} values, its response at most {like.shape[1]}")
        out[i, :value.numel()] = value
    return out


def post_process_rewards(config: TrainConfig, samples: Sequence[Sample], device: torch.device) -> torch.Tensor:
    """slime's `--custom-reward-post-process-path`: fn(args, samples) -> (raw_rewards, rewards) replaces the group
    normalization; returns the rewards [B] the estimator takes. Samples carry their reward dict (reward_scores)
    when the reward function returned one, so `sample.get_reward_value(args)` picks reward_key as in slime."""
    fn = _load("custom_reward_post_process_path", config.custom_reward_post_process_path)
    views = []
    for sample in samples:
        view = PluginSample.from_record(sample)
        view.reward = dict(sample.reward_scores) if sample.reward_scores else sample.reward
        views.append(view)
    result = fn(slime_args(config), views)
    if not isinstance(result, tuple) or len(result) != 2 or len(result[1]) != len(samples):
        raise ValueError(f"custom_reward_post_process_path {config.custom_reward_post_process_path}: expected "
                         f"(raw_rewards, rewards) with {len(samples)} rewards, got {type(result).__name__}")
    return torch.tensor([float(r) for r in result[1]], dtype=torch.float32, device=device)


def custom_advantages(config: TrainConfig, batch: RolloutBatch, *, rewards: torch.Tensor,
                      kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slime's `--custom-advantage-function-path`: fn(args, rollout_data) fills rollout_data["advantages"] and
    ["returns"] (per-sample [R_i] tensors) from slime's rollout_data keys; returns them padded [B, R]."""
    fn = _load("custom_advantage_function_path", config.custom_advantage_function_path)
    lengths = batch.response_lengths.tolist()
    data: dict[str, Any] = {
        "rewards": rewards.tolist(), "raw_reward": batch.rewards.tolist(), "response_lengths": lengths,
        "total_lengths": batch.total_lengths, "loss_masks": per_sample(batch.loss_masks, lengths),
        "kl": per_sample(kl, lengths)}
    for key in ("log_probs", "ref_log_probs", "rollout_log_probs", "values", "teacher_log_probs"):
        if getattr(batch, key) is not None:
            data[key] = per_sample(getattr(batch, key), lengths)
    fn(slime_args(config), data)
    where = f"custom_advantage_function_path {config.custom_advantage_function_path}"
    if "advantages" not in data or "returns" not in data:
        raise ValueError(f"{where}: must set rollout_data['advantages'] and rollout_data['returns']")
    return (padded(data["advantages"], batch.loss_masks, f"{where}: advantages") * batch.loss_masks,
            padded(data["returns"], batch.loss_masks, f"{where}: returns"))


TisFunction = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def tis_function(config: TrainConfig, mb: RolloutBatch) -> TisFunction:
    """slime's `--custom-tis-function-path` on a micro-batch: (pg [b, R], train log-probs [b, R]) -> (pg weighted
    [b, R], the kept-token mask [b, R], per-token metrics [b, R]), through slime's flat pg_loss and per-sample lists.
    Under megatron's context parallelism the function gets, as in slime, each sample's part on this CP rank of pg,
    train and rollout log-probs (`cp_responses`; the loss masks whole), and its flat per-token results are gathered
    back into whole responses (every CP rank computes the whole loss); at CP 1 each sample is whole."""
    fn = _load("custom_tis_function_path", config.custom_tis_function_path)
    lengths, totals = mb.response_lengths.tolist(), mb.total_lengths
    cp = cp_responses.current()

    def local(x: torch.Tensor) -> list[torch.Tensor]:  # [b, R] -> each sample's part on this CP rank
        return [cp_responses.slice_response(x[i, :n], total, n, cp)
                for i, (n, total) in enumerate(zip(lengths, totals, strict=True))]

    def whole(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # the samples' flat local parts -> [b, R]
        sizes = [len(part) for part in local(like)]
        out = like.new_zeros(like.shape)
        for i, part in enumerate(torch.as_tensor(flat).to(like.device, like.dtype).split(sizes)):
            out = out.index_put((torch.tensor([i], device=like.device), torch.arange(lengths[i], device=like.device)),
                                cp_responses.gather_response(part, totals[i], lengths[i], cp))
        return out

    def call(pg: torch.Tensor, train_log_probs: torch.Tensor):
        if mb.rollout_log_probs is None:
            raise ValueError("custom_tis_function_path needs the engines' log-probs (rollout_log_probs)")
        pg_flat, masks, metrics = fn(
            args=slime_args(config), pg_loss=torch.cat(local(pg)), train_log_probs=local(train_log_probs.detach()),
            rollout_log_probs=local(mb.rollout_log_probs.to(pg.device)),
            loss_masks=per_sample(mb.loss_masks, lengths), total_lengths=totals, response_lengths=lengths)
        keep = padded(masks, mb.loss_masks, f"custom_tis_function_path {config.custom_tis_function_path}: loss_masks")
        metrics = {k: whole(torch.as_tensor(v).float().detach(), pg.detach()) for k, v in metrics.items()}
        return whole(pg_flat, pg), keep, metrics

    return call
