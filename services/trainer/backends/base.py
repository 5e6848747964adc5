"""What every training backend offers the loop (`TrainBackend`), and the custom loss a backend may train with.

A backend's settings are `settings/train.py`'s `TrainConfig`; the checkpoint half of the interface is
`checkpoint/iterations.py`'s `ShardedState`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from services.common import plugins
from services.common.samples import Sample
from services.common.shares import Share
from services.trainer.checkpoint.backend_state import BackendState
from services.trainer.settings.train import CUSTOM_LOSS_SIGNATURE, TrainConfig

if TYPE_CHECKING:
    import torch


def load_custom_loss(path: str) -> Callable:
    """The custom loss function at import path `path`, checked for slime's four-argument signature."""
    return plugins.load_function(path, flag="custom_loss_function_path", expected=CUSTOM_LOSS_SIGNATURE,
                                 num_params=4, is_async=False)


class TrainBackend(BackendState, Protocol):
    """A policy being trained: everything the driver calls. Log-probs, one rollout's optimizer steps, the reference
    model, checkpoints in the backend's own format (`BackendState`), HF export, and its weights for the engines.
    Methods of a backend spread over ranks are collective: every rank calls them."""

    config: TrainConfig
    model_path: Path  # the HF directory it started from: the engines' base model and the tokenizer files

    @property
    def weight_version(self) -> int:
        """0 for the loaded weights, +1 for every rollout trained on."""
        ...

    def rollout_share(self) -> Share:
        """The share of every rollout this rank reads from the buffer and trains on (what `train_rollout` takes)."""
        ...

    def compute_log_probs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per sample, the current policy's log-prob of each response token (at rollout_temperature)."""
        ...

    def train_rollout(self, samples: Sequence[Sample]) -> list[dict[str, float]]:
        """Train on one rollout; one `train/...` metrics dict per optimizer step."""
        ...

    def load(self, path: str | Path) -> None:
        """Replace the policy's weights with those of an HF checkpoint directory (e.g. one `save_hf` wrote)."""
        ...

    def load_ref(self, path: str | Path) -> None:
        """Replace the reference model's weights with an HF checkpoint's (slime's --ref-load)."""
        ...

    def update_ref_model(self) -> None:
        """Copy the policy into the reference model (slime's --ref-update-interval)."""
        ...

    def load_teacher(self, path: str | Path) -> None:
        """Replace the on-policy-distillation teacher's weights with an HF checkpoint's (slime's --opd-teacher-load)."""
        ...

    def named_weights(self, *, adapters_merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight once, for the broadcast to the engines; a LoRA policy's merged, or its
        base model's (adapters_merged=False)."""
        ...

    def adapter_weights(self) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
        """A LoRA policy (config.lora) for the engines: PEFT's adapter config and the adapter's tensors under PEFT's
        names, on rank 0 (the others get none). Collective."""
        ...

    def save_hf(self, path: str | Path) -> None:
        """Write an HF checkpoint directory (safetensors, config, tokenizer files) transformers can load."""
        ...
