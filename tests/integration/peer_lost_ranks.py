"""Two ranks of a real gloo world for test_peer_lost: `python -m tests.integration.peer_lost_ranks RANK PORT MODE OUT`.
Rank 1 leaves after a first barrier (MODE kill: SIGKILLs itself; MODE stall: stays alive but silent past the group's
timeout); rank 0 then runs a broadcast and an all-reduce and writes, for each, the error's text and `peer_lost`; then it
closes the world (OUT.closed: the error World.close raised, if any)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

JOIN_TIMEOUT_S = 120.0  # forming the world: generous, under load
GROUP_TIMEOUT_S = 3.0   # the collectives' group: short, for the stall to time out


def main(rank: int, port: int, mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from services.trainer.distributed.parallel import init_world, peer_lost
    from services.trainer.ranks.rank_exit import exit_rank

    world = init_world(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, device="cpu",
                       timeout_s=JOIN_TIMEOUT_S)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    world.barrier()
    if rank == 1:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(GROUP_TIMEOUT_S * 4)  # silent: rank 0's collectives time out
        exit_rank(0)
    time.sleep(0.5)  # rank 1 is gone (or silent) before rank 0's first collective
    results = []
    for collective in (lambda: dist.broadcast_object_list([{"x": 1}], src=0, group=group),
                       lambda: dist.all_reduce(torch.ones(2), group=group)):
        try:
            collective()
            results.append({"error": "", "peer_lost": False})
        except Exception as err:  # noqa: BLE001 - what rank 0's driver would see
            results.append({"error": f"{type(err).__name__}: {err}", "peer_lost": peer_lost(err)})
    with open(out, "w") as f:
        json.dump(results, f)
    try:  # the world's group is broken too: its closing barrier fails (or times out), and close returns
        world.close()
        closed = ""
    except Exception as err:  # noqa: BLE001 - what the test reports
        closed = f"{type(err).__name__}: {err}"
    Path(f"{out}.closed").write_text(json.dumps({"error": closed}))
    exit_rank(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
