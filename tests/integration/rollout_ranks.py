"""One trainer rank of the share test: `python -m tests.integration.rollout_ranks OUT BUFFER_ADDR JOB` with
torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Each rank gets its share as the driver's modes do (sync's
collect on rollout 0, fully_async's take on rollout 1) against the real buffer, with every broadcast from rank 0
recorded, and writes what it got as JSON. The manager is not asked to start anything: the test wrote the rollouts'
groups to the buffer as a manager does. Then rank 1 fails to read its share of rollout 0 again.
"""

from __future__ import annotations

import functools
import json
import sys
import types
from pathlib import Path

from services.buffer.client import BufferClient
from services.common.errors import Unavailable
from services.trainer.api.config import TrainerConfig
from services.trainer.api.spec import parse_spec
from services.trainer.distributed.parallel import RankAborted, init_world, rollout_share
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.rollouts import Rollouts
from services.trainer.ranks.rank_exit import exit_rank

SPEC = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 2, "rollout_batch_size": 8,
        "n_samples_per_prompt": 2, "global_batch_size": 8}


def main(out_dir: str, buffer_addr: str, job_id: str) -> None:
    config = TrainerConfig()
    world = init_world(rank=config.rank, world_size=config.world_size, master_addr=config.master_addr,
                       master_port=config.master_port, timeout_s=120)
    broadcasts: list[str] = []
    plain_broadcast = world.broadcast

    def recorded(obj):
        broadcasts.append(repr(obj))
        return plain_broadcast(obj)

    world.broadcast = recorded
    share = rollout_share(rank=world.rank, world_size=world.world_size, global_batch_size=SPEC["global_batch_size"],
                          n_samples_per_prompt=SPEC["n_samples_per_prompt"])
    ctx = types.SimpleNamespace(check_cancelled=lambda: None)
    got = {}
    with BufferClient(buffer_addr, timeout_s=30.0) as buffer:
        deps = TrainerDeps(buffer=buffer, world=world)
        for rollout_id, mode in enumerate(("sync", "fully_async")):
            spec = parse_spec({**SPEC, "job_id": job_id, "mode": mode, "max_weight_staleness": 1})
            rollouts = Rollouts(spec.driver, spec.rollout, deps, ctx if world.rank == 0 else None, share=share)
            rollouts.start = lambda *args: None  # the groups are in the buffer already
            groups = rollouts.take if mode == "fully_async" else rollouts.collect
            samples = rollouts.samples(rollout_id, functools.partial(groups, rollout_id))
            got[mode] = {"tokens": [s.tokens for s in samples],
                         "metrics": rollouts.rollout_metrics(samples, rollout_id)}
        # a rank that cannot read its share ends the rollout on every rank, not in training's collectives
        if world.rank == 1:
            buffer.get_batch = lambda *args, **kwargs: (_ for _ in ()).throw(Unavailable("buffer: connection refused"))
        rollouts = Rollouts(spec.driver, spec.rollout, deps, ctx if world.rank == 0 else None, share=share)
        rollouts.start = lambda *args: None
        try:
            rollouts.samples(0, functools.partial(rollouts.take, 0))
        except RankAborted as err:
            got["aborted"] = str(err)
    (Path(out_dir) / f"rank{world.rank}.json").write_text(json.dumps({"got": got, "broadcasts": broadcasts}))
    exit_rank(0, world)


if __name__ == "__main__":
    main(*sys.argv[1:])
