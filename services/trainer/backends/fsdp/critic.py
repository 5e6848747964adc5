"""PPO's critic: the policy's architecture with a value head (an HF backbone + Linear(hidden, 1)) and its own AdamW.

Values are read at the same positions as the policy's log-probs (the logits that predict each response token) and
are not temperature-scaled (slime's `get_values`). The backend trains it; the formulas are in `rl_step`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.errors import InvalidArgument
from services.trainer.batching import varlen
from services.trainer.batching.batch import RolloutBatch
from services.trainer.batching.packing import gather_response
from services.trainer.settings.train import TrainConfig
from services.trainer.step.optim import make_adamw


def initial_value_head(hidden_size: int, init_std: float, seed: int) -> torch.Tensor:
    """The value head's first weight [1, hidden] ~ N(0, init_std²), from the job's seed: the same on every rank and
    in every backend."""
    return torch.randn(1, hidden_size, generator=torch.Generator().manual_seed(seed)) * init_std


class ValueModel(torch.nn.Module):
    """A decoder backbone and a bias-free Linear(hidden, 1) head: per-position scalar values [B, L]."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int, init_std: float, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1, bias=False)
        with torch.no_grad():
            self.value_head.weight.copy_(initial_value_head(hidden_size, init_std, seed))

    def forward(self, **inputs) -> torch.Tensor:
        """inputs: the backbone's (input_ids with attention_mask, or packed with position_ids) -> [rows, L]."""
        hidden = self.backbone(**inputs, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


class Critic:
    """The value model (initialised from the policy's checkpoint, untied, new head) and its optimizer."""

    def __init__(self, model_path: str | Path, config: TrainConfig, device: torch.device | None = None) -> None:
        from transformers import AutoModel

        try:
            backbone = AutoModel.from_pretrained(model_path, dtype=torch.float32)
        except (OSError, ValueError) as err:
            raise InvalidArgument(f"model {model_path}: cannot load a backbone for the critic ({err})") from err
        varlen.use_in(backbone)
        hf_config = backbone.config.get_text_config()
        self.model = ValueModel(backbone, hf_config.hidden_size, getattr(hf_config, "initializer_range", 0.02),
                                seed=config.seed).eval()
        self.model.to(device or torch.device("cpu"))
        self.optimizer = make_adamw(self.model.named_parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                    adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2,
                                    adam_eps=config.adam_eps)

    def values(self, mb: RolloutBatch, inputs: dict | None = None) -> torch.Tensor:
        """Response-aligned values [b, R] of a micro-batch laid out as `inputs` (packed or padded, as the policy's
        forward; None: padded), with grad when grad is enabled."""
        inputs = inputs or {"input_ids": mb.tokens, "attention_mask": mb.attention_mask}
        return gather_response(self.model(**inputs), mb)
