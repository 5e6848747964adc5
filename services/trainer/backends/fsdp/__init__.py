"""The torch backend: an HF causal LM trained with FSDP2 (`backend.TorchBackend`), its context parallelism
(`context_parallel.py`, `cp_attention.py`) and PPO's critic (`critic.py`).

The package registers its builder; `backend.py` (torch and transformers) loads when a job builds one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from services.trainer.backends.layout import LayoutConfig
from services.trainer.backends.registry import register
from services.trainer.distributed.parallel import World
from services.trainer.settings.train import TrainConfig

if TYPE_CHECKING:
    from services.trainer.backends.fsdp.backend import TorchBackend


@register("fsdp")
def build(hf_checkpoint: str, config: TrainConfig, layout: LayoutConfig, world: World,
          num_threads: int, base_model=None) -> TorchBackend:
    """Each rank gets a TrainConfig cut to its data-parallel share of each step (the ranks of a context-parallel
    group share theirs). `base_model`: a LoRA job's shared base (`lora/shared_base.py`), already loaded."""
    from services.trainer.backends.fsdp.backend import TorchBackend

    job_global_batch_size = config.global_batch_size
    if (dp_size := world.world_size // layout.context_parallel_size) > 1:
        local = config.global_batch_size and config.global_batch_size // dp_size
        config = dataclasses.replace(config, global_batch_size=local)
    return TorchBackend(hf_checkpoint, config, num_threads=num_threads, world=world,
                        job_global_batch_size=job_global_batch_size,
                        context_parallel_size=layout.context_parallel_size, base_model=base_model)
