"""PPO's critic on megatron-core: the policy's GPTModel (this stage, this TP shard) whose output layer is a value
head, Linear(hidden, 1) without bias, as slime's megatron critic and the fsdp backend's `ValueModel`.

The head is whole on every tensor-parallel rank (it sees the whole hidden state; under sequence parallelism the
tokens are gathered first) and starts from `critic.initial_value_head`, so both backends start from the same critic.
The backbone starts from the policy's HF checkpoint. Values are read where the policy reads log-probs, without
temperature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.trainer.backends.fsdp.critic import initial_value_head
from services.trainer.batching import packing
from services.trainer.batching.batch import RolloutBatch


class ValueHead(torch.nn.Module):
    """GPTModel's output layer for a critic: hidden [s, b, h] -> values [s, b, 1] (GPTModel's call: the tied
    weight and the gather flag, which a value head has no use for)."""

    def __init__(self, weight: torch.Tensor, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden)
        return F.linear(hidden, self.weight.to(hidden.dtype)), None


def attach_value_head(gpt, *, hidden_size: int, init_std: float, seed: int) -> None:
    """Replace the last pipeline stage's output layer of `gpt` with the critic's value head (other stages have
    none)."""
    if not getattr(gpt, "post_process", False):
        return
    device = next(gpt.parameters()).device
    weight = initial_value_head(hidden_size, init_std, seed).to(device=device, dtype=gpt.config.params_dtype)
    gpt.output_layer = ValueHead(weight, sequence_parallel=gpt.config.sequence_parallel)


def response_values(output: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
    """The critic GPTModel's output, padded [b, L, 1] or packed [1, T, 1] -> response-aligned float32 values
    [b, R]."""
    return packing.gather_response(output[..., 0], mb).float()
