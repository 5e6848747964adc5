"""The local layer spec's RMSNorm with Megatron's sequence parallelism: torch's RMSNorm (megatron-core's own torch
wrapper refuses sequence_parallel), its weight marked `sequence_parallel` so that finalize_model_grads sums its
gradient over the tensor-parallel ranks, each of which normalized a slice of the tokens.
"""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
