"""The torch backend: an HF causal LM trained in one process (float32, CPU) with AdamW and gradient accumulation.

It owns the model, the optimizer and the step schedule; formulas come from `services.trainer.algorithms`.
FSDP2 sharding is left to a later `parallelize.py`; the weight broadcast to engines to `weight_sync.py`.
"""

from __future__ import annotations

import copy
import logging
import math
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.algorithms.advantages import get_advantage_estimator, post_process_rewards
from services.trainer.algorithms.losses import (
    Reducer,
    policy_loss_function,
    sft_loss_function,
    sum_of_sample_mean,
    sum_of_token,
    token_log_probs_and_entropy,
)
from services.trainer.backends.base import TrainConfig
from services.trainer.batch import RolloutBatch, build_rollout_batch

log = logging.getLogger(__name__)

# Copied next to the weights by save_hf, so the directory is a complete model for transformers and the engines.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")

Rows = tuple[int, int]  # [start, end) sample rows of one micro-batch


def step_schedule(num_samples: int, *, global_batch_size: int | None, micro_batch_size: int) -> list[list[Rows]]:
    """Micro-batch row ranges per optimizer step: steps of global_batch_size samples (None: one step of all), each
    cut into micro_batch_size chunks; trailing samples that do not fill a step are dropped, as in slime."""
    step_size = global_batch_size or num_samples
    if step_size == 0:
        return []
    steps = []
    for start in range(0, num_samples - step_size + 1, step_size):
        end = start + step_size
        steps.append([(b, min(b + micro_batch_size, end)) for b in range(start, end, micro_batch_size)])
    return steps


def _load_causal_lm(path: Path):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"model {path}: cannot load a causal LM ({err})") from err
    # No dropout: the training forward, the no-grad recompute and the engines see the same policy.
    return model.eval()


class TorchBackend:
    """One process, one model: `train_rollout` runs slime's per-rollout schedule (recompute log-probs, advantages,
    global_batch_size steps of micro_batch_size micro-batches)."""

    def __init__(self, model_path: str | Path, config: TrainConfig, num_threads: int | None = None) -> None:
        self.model_path = Path(model_path)
        self.config = config
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(config.seed)
        self.model = _load_causal_lm(self.model_path)
        self.ref_model = copy.deepcopy(self.model).requires_grad_(False) if config.use_kl_loss else None
        self.optimizer = self._make_optimizer()
        pad = self.model.config.pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)
        self._weight_version = 0
        log.info("loaded %s: %.1fM parameters, loss %s, reference model %s", self.model_path,
                 sum(p.numel() for p in self.model.parameters()) / 1e6, config.loss_type, self.ref_model is not None)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def _make_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.config
        return torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                 eps=cfg.adam_eps, weight_decay=cfg.weight_decay)

    def load(self, path: str | Path) -> None:
        """Replace the policy's weights with an HF checkpoint's, with fresh optimizer state (the reference stays)."""
        source = _load_causal_lm(Path(path))
        with torch.no_grad():
            self.model.load_state_dict(source.state_dict())
        self.optimizer = self._make_optimizer()

    def _forward(self, model: torch.nn.Module, mb: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Response-aligned (log_probs [b, R], entropy [b, R]) at the rollout temperature."""
        logits = model(input_ids=mb.tokens, attention_mask=mb.attention_mask, use_cache=False).logits
        rows = torch.arange(mb.size).unsqueeze(-1)
        return token_log_probs_and_entropy(logits[rows, mb.logit_positions()], mb.response_tokens,
                                           temperature=self.config.rollout_temperature)

    @torch.no_grad()
    def _recompute(self, model: torch.nn.Module, batch: RolloutBatch, micro_batches: list[Rows]) -> torch.Tensor:
        """[B, R] log-probs without grad, in the same micro-batches the training forward will use."""
        out = torch.zeros_like(batch.loss_masks)
        for start, end in micro_batches:
            log_probs, _ = self._forward(model, batch.select(start, end))
            out[start:end, :log_probs.shape[1]] = log_probs
        return out

    def compute_log_probs(self, samples: Sequence[Sample]) -> list[list[float]]:
        batch = build_rollout_batch(samples, pad_token_id=self.pad_token_id)
        mbs = self.config.micro_batch_size
        log_probs = self._recompute(self.model, batch, [(s, min(s + mbs, batch.size))
                                                        for s in range(0, batch.size, mbs)])
        return [log_probs[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]

    def train_rollout(self, samples: Sequence[Sample]) -> list[dict[str, float]]:
        cfg = self.config
        batch = build_rollout_batch(samples, pad_token_id=self.pad_token_id)
        steps = step_schedule(batch.size, global_batch_size=cfg.global_batch_size,
                              micro_batch_size=cfg.micro_batch_size)
        if not steps:
            raise InvalidArgument(f"rollout has {batch.size} samples, fewer than global_batch_size "
                                  f"{cfg.global_batch_size}")
        if (used := steps[-1][-1][1]) < batch.size:
            log.warning("dropping the last %d of %d samples: they do not fill a step of global_batch_size %d",
                        batch.size - used, batch.size, cfg.global_batch_size)
        old_log_probs = ref_log_probs = None
        if cfg.loss_type == "policy_loss":
            rewards = post_process_rewards(
                batch.rewards, advantage_estimator=cfg.advantage_estimator,
                n_samples_per_prompt=cfg.n_samples_per_prompt,
                rewards_normalization=not cfg.disable_rewards_normalization,
                grpo_std_normalization=not cfg.disable_grpo_std_normalization)
            estimator = get_advantage_estimator(cfg.advantage_estimator)
            batch = batch.with_advantages(estimator(rewards, loss_mask=batch.loss_masks))
            micro_batches = [rows for step in steps for rows in step]
            old_log_probs = self._recompute(self.model, batch, micro_batches)
            if self.ref_model is not None:
                ref_log_probs = self._recompute(self.ref_model, batch, micro_batches)
        metrics = [self._train_step(batch, step, old_log_probs, ref_log_probs) for step in steps]
        self._weight_version += 1
        return metrics

    def _reducer(self, loss_mask: torch.Tensor, denominators: torch.Tensor, normalizer: float) -> Reducer:
        if self.config.calculate_per_token_loss:
            return lambda x: sum_of_token(x, loss_mask) / normalizer
        return lambda x: sum_of_sample_mean(x, loss_mask, denominators=denominators) / normalizer

    def _train_step(self, batch: RolloutBatch, micro_batches: list[Rows], old_log_probs: torch.Tensor | None,
                    ref_log_probs: torch.Tensor | None) -> dict[str, float]:
        """One optimizer step over `micro_batches`; the loss is normalized by the whole step's sample (or token)
        count, so it and its gradient do not depend on how the step is cut into micro-batches."""
        cfg = self.config
        first, last = micro_batches[0][0], micro_batches[-1][1]
        # Each sample is its own rollout here, so its denominator is its own loss-mask total (slime's
        # rollout_mask_sums with no fan-out).
        denominators = batch.loss_masks.sum(dim=-1)
        normalizer = (float(denominators[first:last].clamp_min(1).sum()) if cfg.calculate_per_token_loss
                      else float(last - first))
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for start, end in micro_batches:
            mb = batch.select(start, end)
            log_probs, entropy = self._forward(self.model, mb)
            reduce = self._reducer(mb.loss_masks, denominators[start:end], normalizer)
            if cfg.loss_type == "sft_loss":
                loss, metrics = sft_loss_function(log_probs=log_probs, reduce=reduce)
            else:
                width = log_probs.shape[1]
                loss, metrics = policy_loss_function(
                    log_probs=log_probs, entropy=entropy, old_log_probs=old_log_probs[start:end, :width],
                    advantages=mb.advantages, reduce=reduce, eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high,
                    entropy_coef=cfg.entropy_coef,
                    ref_log_probs=None if ref_log_probs is None else ref_log_probs[start:end, :width],
                    kl_loss_coef=cfg.kl_loss_coef, kl_loss_type=cfg.kl_loss_type,
                    rollout_log_probs=mb.rollout_log_probs)
            loss.backward()
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), cfg.clip_grad if cfg.clip_grad > 0 else math.inf))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"grad norm is {grad_norm} on samples [{first}, {last}); step not applied")
        self.optimizer.step()
        return {**{f"train/{key}": value for key, value in totals.items()},
                "train/grad_norm": grad_norm, "train/lr": float(self.optimizer.param_groups[0]["lr"])}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and tensors; a tied weight (lm_head.weight under tied embeddings) comes once, first name."""
        seen: set[int] = set()
        for name, tensor in self.model.state_dict().items():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            yield name, tensor.detach()

    def save_hf(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        for name in TOKENIZER_FILES:
            if (self.model_path / name).is_file():
                shutil.copy2(self.model_path / name, path / name)
        log.info("saved HF checkpoint to %s", path)
