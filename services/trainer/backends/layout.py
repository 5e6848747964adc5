"""Which backend trains a job and how its ranks are laid out (Megatron's parallel sizes and pass-through flags),
checked against what that backend can do (`capabilities.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.config import POSITIVE, check_fields, field
from services.trainer.backends.capabilities import BackendName, Capabilities, backends_that, capabilities

CUSTOM_LOSS_REFUSAL = ("context_parallel_size > 1 does not run loss_type custom_loss: a custom loss takes the whole "
                       "packed row's logits, which no rank of a context-parallel group holds")
# a layout setting beyond its default -> the capability it needs
NEEDS: dict[str, str] = {"tensor_model_parallel_size": "tensor_parallel",
                         "pipeline_model_parallel_size": "pipeline_parallel",
                         "expert_model_parallel_size": "expert_parallel",
                         "expert_tensor_parallel_size": "expert_parallel", "megatron": "extra_flags"}


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    train_backend: BackendName = field("fsdp", "fsdp (torch FSDP2) or megatron (megatron-core)")
    tensor_model_parallel_size: int = field(1, "megatron: tensor-parallel ranks", POSITIVE)
    pipeline_model_parallel_size: int = field(1, "megatron: pipeline stages", POSITIVE)
    expert_model_parallel_size: int = field(1, "megatron: ranks a MoE model's experts are spread over (carved out of "
                                               "the tensor- and data-parallel ranks)", POSITIVE)
    expert_tensor_parallel_size: int = field(1, "megatron: ranks each expert is cut over (1: whole on each rank; or "
                                                "tensor_model_parallel_size)", POSITIVE)
    context_parallel_size: int = field(1, "ranks that split every sequence between them (Megatron's "
                                          "load-balanced chunks; each group of this many consecutive ranks trains "
                                          "one data-parallel share)", POSITIVE)
    use_distributed_optimizer: bool = field(True, "megatron: shard the optimizer state over data-parallel ranks")
    megatron: dict[str, Any] = field({}, "extra TransformerConfig/optimizer flags by Megatron's names (slime passes "
                                          "them on)")

    def __post_init__(self) -> None:
        check_fields(self)
        caps = self.capabilities
        unable = [name for name, need in NEEDS.items()
                  if getattr(self, name) not in (1, {}) and not getattr(caps, need)]
        if unable:
            able = backends_that(lambda c: all(getattr(c, NEEDS[name]) for name in unable))
            raise ValueError(f"{' and '.join(unable)}: train_backend {self.train_backend} cannot run these settings; "
                             f"they need train_backend: {' or '.join(able) or '(none)'}")
        if self.context_parallel_size > 1 and not caps.context_parallel:
            able = " or ".join(backends_that(lambda c: c.context_parallel))
            raise ValueError(f"context_parallel_size {self.context_parallel_size}: train_backend "
                             f"{self.train_backend} has no context parallelism (megatron-core's local attention "
                             f"cannot split a sequence); set train_backend: {able} (slime: --train-backend {able})")

    @property
    def capabilities(self) -> Capabilities:
        """What the chosen backend can do."""
        return capabilities(self.train_backend)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size
