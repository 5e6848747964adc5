"""What a job runs with besides its spec: the peers, the trainer's ranks, where the weight group and TensorBoard go,
where the dashboard's copy of the samples goes, and the base models LoRA jobs share. Its own module so that the loop
and the parts it builds import it, and not each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.buffer.client import BufferClient
from services.rollout.client import RolloutClient
from services.trainer.distributed.parallel import World
from services.trainer.driver.sample_board import SampleBoard
from services.trainer.lora.shared_base import SharedBases


@dataclass
class TrainerDeps:
    """The peers (the buffer on every rank, each reading its own share of a rollout; the rollout manager on rank 0
    only, None on the others), the trainer's ranks, where rank 0 hosts the weight-sync group, where TensorBoard
    event files go, and rank 0's sample board."""

    buffer: BufferClient | None = None
    rollout: RolloutClient | None = None
    master_address: str = "127.0.0.1"
    num_threads: int = 2
    world: World = field(default_factory=World)
    tensorboard_dir: str = ""
    board: SampleBoard | None = None  # rank 0's: the latest rollout's samples, for the dashboard
    shared_bases: SharedBases = field(default_factory=SharedBases)  # lora_share_pool jobs' base models, by key
