"""Run a function on a gloo group of CPU ranks, each in its own spawned process, and collect what each rank returns:
tests of collectives, one process per rank."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(fn: Callable[[int, int], dict], world_size: int = 2) -> list[dict]:
    """fn(rank, world_size) on each rank of a gloo group (one torch thread each), the default group set up before it
    and torn down after; the dicts of tensors the ranks return, in rank order. fn must be importable by name (a
    module-level function), as the spawned processes find it."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(fn, world_size, out), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out, f"rank{rank}.pt")) for rank in range(world_size)]


def _rank(rank: int, fn: Callable[[int, int], dict], world_size: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'init')}", rank=rank,
                            world_size=world_size)
    torch.set_num_threads(1)
    try:
        torch.save(fn(rank, world_size), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
