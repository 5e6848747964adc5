"""The megatron-core backend: GPTModel with TP × PP × DP, Megatron DDP and distributed optimizer, HF conversion.

Nothing here imports megatron at package import (it costs ~6 s); `backend.MegatronBackend` loads it when built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.errors import InvalidArgument
from services.trainer.backends.layout import LayoutConfig
from services.trainer.backends.registry import register
from services.trainer.distributed.parallel import World
from services.trainer.settings.train import TrainConfig

if TYPE_CHECKING:
    from services.trainer.backends.megatron.backend import MegatronBackend


@register("megatron")
def build(hf_checkpoint: str, config: TrainConfig, layout: LayoutConfig, world: World,
          num_threads: int) -> MegatronBackend:
    """Megatron takes whole steps and splits them over its data-parallel ranks itself."""
    from services.trainer.backends.megatron.backend import MegatronBackend

    if world.world_size % layout.model_parallel_size:
        raise InvalidArgument(f"train_backend megatron: {world.world_size} trainer ranks are not a multiple of "
                              f"tensor_model_parallel_size × pipeline_model_parallel_size "
                              f"({layout.model_parallel_size})")
    per_stage = world.world_size // layout.pipeline_model_parallel_size  # experts are not split by TP (expert TP 1)
    if per_stage % layout.expert_model_parallel_size:
        raise InvalidArgument(f"train_backend megatron: expert_model_parallel_size {layout.expert_model_parallel_size} "
                              f"must divide the {per_stage} tensor- and data-parallel ranks of a pipeline stage")
    return MegatronBackend(hf_checkpoint, config, tensor_model_parallel_size=layout.tensor_model_parallel_size,
                           pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
                           use_distributed_optimizer=layout.use_distributed_optimizer, megatron_args=layout.megatron,
                           num_threads=num_threads, world=world,
                           expert_model_parallel_size=layout.expert_model_parallel_size,
                           context_parallel_size=layout.context_parallel_size)
