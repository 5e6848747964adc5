"""One trainer rank of the share test: `python -m tests.integration.feed_ranks OUT BUFFER_ADDR JOB` with torchrun's
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Each rank runs the driver's feeds (sync on rollout 0, fully_async on
rollout 1) against the real buffer, with every broadcast from rank 0 recorded, and writes what it got as JSON.
The manager is not asked to start anything: the test wrote the rollouts' groups to the buffer as a manager does.
Then rank 1 fails to read its share of rollout 0 again.
"""

from __future__ import annotations

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
from services.trainer.driver.feed import make_feed

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
            feed = make_feed(spec.driver, spec.rollout, deps, ctx if world.rank == 0 else None, share=share)
            feed._start = lambda *args: None  # the groups are in the buffer already
            samples = feed.samples(rollout_id)
            got[mode] = {"tokens": [s.tokens for s in samples],
                         "metrics": feed.rollout_metrics(samples, rollout_id)}
            feed.close()
        # a rank that cannot read its share ends the rollout on every rank, not in training's collectives
        if world.rank == 1:
            buffer.get_batch = lambda *args, **kwargs: (_ for _ in ()).throw(Unavailable("buffer: connection refused"))
        feed = make_feed(spec.driver, spec.rollout, deps, ctx if world.rank == 0 else None, share=share)
        feed._start = lambda *args: None
        try:
            feed.samples(0)
        except RankAborted as err:
            got["aborted"] = str(err)
    (Path(out_dir) / f"rank{world.rank}.json").write_text(json.dumps({"got": got, "broadcasts": broadcasts}))
    world.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
