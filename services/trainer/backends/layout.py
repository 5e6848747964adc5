"""Which backend trains a job and how its ranks are laid out (Megatron's parallel sizes and pass-through flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from services.common.config import POSITIVE, check_fields, field

BackendName = Literal["fsdp", "megatron"]
CUSTOM_LOSS_REFUSAL = ("context_parallel_size > 1 does not run loss_type custom_loss: a custom loss takes the whole "
                       "packed row's logits, which no rank of a context-parallel group holds")


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    train_backend: BackendName = field("fsdp", "fsdp (torch FSDP2) or megatron (megatron-core)")
    tensor_model_parallel_size: int = field(1, "megatron: tensor-parallel ranks", POSITIVE)
    pipeline_model_parallel_size: int = field(1, "megatron: pipeline stages", POSITIVE)
    expert_model_parallel_size: int = field(1, "megatron: ranks a MoE model's experts are spread over (carved out of "
                                               "the data-parallel ranks)", POSITIVE)
    context_parallel_size: int = field(1, "fsdp: ranks that split every sequence between them (Megatron's "
                                          "load-balanced chunks; each group of this many consecutive ranks trains "
                                          "one data-parallel share)", POSITIVE)
    use_distributed_optimizer: bool = field(True, "megatron: shard the optimizer state over data-parallel ranks")
    megatron: dict[str, Any] = field({}, "extra TransformerConfig/optimizer flags by Megatron's names (slime passes "
                                          "them on)")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.train_backend != "megatron" and (self.model_parallel_size > 1 or self.megatron
                                                 or self.expert_model_parallel_size > 1):
            raise ValueError("tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size "
                             "and megatron need train_backend: megatron")
        if self.context_parallel_size > 1 and self.train_backend != "fsdp":
            raise ValueError(f"context_parallel_size {self.context_parallel_size}: train_backend "
                             f"{self.train_backend} has no context parallelism (megatron-core's local attention "
                             "cannot split a sequence); set train_backend: fsdp (slime: --train-backend fsdp)")

    @property
    def trains_critic(self) -> bool:
        """Whether the backend can train PPO's critic (megatron does not)."""
        return self.train_backend == "fsdp"

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size
