"""What every training backend offers the loop (`TrainBackend`), and the training settings it takes (`TrainConfig`).

Field names and defaults are slime's flags; the job spec is cut into this config by the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from services.common.config import field
from services.common.samples import Sample

if TYPE_CHECKING:
    import torch

LOSS_TYPES = ("policy_loss", "sft_loss")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    loss_type: str = field("policy_loss", "policy_loss (RL) or sft_loss (NLL of the response tokens)")
    advantage_estimator: str = field("grpo", "how rewards become per-token advantages")
    n_samples_per_prompt: int = field(1, "samples per prompt; consecutive samples form one reward group")
    global_batch_size: int | None = field(
        None, "samples per optimizer step; trailing samples that do not fill a step are dropped "
              "(None: the whole rollout is one step)")
    micro_batch_size: int = field(1, "samples per forward/backward; gradients accumulate over a step")
    rollout_temperature: float = field(1.0, "sampling temperature; logits are divided by it before log-softmax")
    eps_clip: float = field(0.2, "PPO clip range: ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]")
    eps_clip_high: float | None = field(None, "upper clip range (DAPO clip-higher); None: eps_clip")
    use_kl_loss: bool = field(False, "keep a frozen reference model and compute a KL-to-reference loss")
    kl_loss_coef: float = field(0.0, "weight of the KL loss (needs use_kl_loss)")
    kl_loss_type: str = field("k1", "KL estimator: k1, k2, k3 or low_var_kl")
    entropy_coef: float = field(0.0, "weight of the entropy bonus (subtracted from the loss)")
    disable_grpo_std_normalization: bool = field(False, "group mean baseline only, no std division (Dr.GRPO)")
    disable_rewards_normalization: bool = field(False, "use raw rewards, no group baseline")
    calculate_per_token_loss: bool = field(False, "global token mean instead of the mean of per-sample means")
    lr: float = field(1e-6, "learning rate (constant)")
    weight_decay: float = field(0.0, "AdamW decoupled weight decay")
    adam_beta1: float = field(0.9, "Adam beta1")
    adam_beta2: float = field(0.98, "Adam beta2")
    adam_eps: float = field(1e-8, "Adam epsilon")
    clip_grad: float = field(1.0, "max global gradient norm; 0 disables clipping")
    seed: int = field(1234, "random seed of the trainer")

    def __post_init__(self) -> None:
        from services.trainer.algorithms.advantages import ESTIMATORS
        from services.trainer.algorithms.kl import KL_LOSS_TYPES

        def one_of(name: str, valid) -> None:
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {', '.join(valid)}, got {getattr(self, name)!r}")

        one_of("loss_type", LOSS_TYPES)
        one_of("advantage_estimator", sorted(ESTIMATORS))
        one_of("kl_loss_type", KL_LOSS_TYPES)
        for name in ("n_samples_per_prompt", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1 (or None), got {self.global_batch_size}")
        for name in ("rollout_temperature", "adam_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("eps_clip", "kl_loss_coef", "lr", "weight_decay", "clip_grad"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not math.isfinite(self.entropy_coef):
            raise ValueError(f"entropy_coef must be finite, got {self.entropy_coef}")
        if self.eps_clip_high is None:
            object.__setattr__(self, "eps_clip_high", self.eps_clip)
        elif not self.eps_clip_high >= 0:
            raise ValueError(f"eps_clip_high must be >= 0 (or None), got {self.eps_clip_high}")
        if self.kl_loss_coef != 0 and not self.use_kl_loss:
            raise ValueError(f"kl_loss_coef is {self.kl_loss_coef} but use_kl_loss is false")
        if self.use_kl_loss and self.loss_type != "policy_loss":
            raise ValueError(f"use_kl_loss applies to loss_type 'policy_loss' only, got {self.loss_type!r}")


class TrainBackend(Protocol):
    """A policy being trained: log-probs, one rollout's optimizer steps, its weights for the engines, HF export."""

    config: TrainConfig

    @property
    def weight_version(self) -> int:
        """0 for the loaded weights, +1 for every rollout trained on."""
        ...

    def load(self, path: str | Path) -> None:
        """Replace the policy's weights with those of an HF checkpoint directory (e.g. one `save_hf` wrote)."""
        ...

    def compute_log_probs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per sample, the current policy's log-prob of each response token (at rollout_temperature)."""
        ...

    def train_rollout(self, samples: Sequence[Sample]) -> list[dict[str, float]]:
        """Train on one rollout; one `train/...` metrics dict per optimizer step."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight once, for the broadcast to the engines."""
        ...

    def save_hf(self, path: str | Path) -> None:
        """Write an HF checkpoint directory (safetensors, config, tokenizer files) transformers can load."""
        ...
