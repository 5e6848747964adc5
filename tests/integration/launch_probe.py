"""A rank started by services.trainer.ranks.launch for test_launch: joins the trainer's world as the trainer would and
writes what it was told (rank 0 writes every rank's view to $PROBE_OUT)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from services.trainer.distributed.parallel import init_world
from services.trainer.ranks.rank_exit import exit_rank

if __name__ == "__main__":
    world = init_world(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                       master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                       device="cpu", timeout_s=120)
    mine = {name: os.environ[name] for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    every = [None] * world.world_size
    dist.all_gather_object(every, {**mine, "dist_rank": dist.get_rank(), "device": str(world.device)})
    if world.rank == 0:
        Path(os.environ["PROBE_OUT"]).write_text(json.dumps(every))
    exit_rank(0, world)
