"""The local layer spec's RMSNorms with Megatron's sequence parallelism: torch's RMSNorm (megatron-core's own torch
wrapper refuses sequence_parallel), its weight marked `sequence_parallel` so that finalize_model_grads sums its
gradient over the tensor-parallel ranks, each of which normalized a slice of the tokens; and the zero-centered one of
Qwen3-Next and Qwen3.5, which scales by 1 + weight (in float32, as transformers' does).
"""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class ZeroCenteredRMSNorm(torch.nn.Module):
    """x / rms(x) · (1 + weight), computed in float32 and cast back; the weight is the checkpoint's (zero: identity
    scale)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)
