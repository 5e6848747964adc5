"""One trainer rank of the per-family data-parallel test: `python -m tests.integration.family_ranks OUT MODEL...`
with torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; trains each model one rollout (two steps) under
FSDP2 and writes rank 0's metrics and HF export. The test runs the same in one process and compares."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.integration.trainer_ranks import BASE, make_samples


def train(model_dir: Path, out_dir: Path, world) -> list[dict[str, float]]:
    """One rollout of two optimizer steps; the metrics averaged over the ranks, then the HF export."""
    from services.trainer.api.spec import parse_spec
    from services.trainer.distributed.parallel import shard_rollout
    from services.trainer.driver.loop import make_backend

    spec = parse_spec({**BASE, "lr_warmup_iters": 0, "hf_checkpoint": str(model_dir)})  # the first step moves
    backend = make_backend(spec, world, num_threads=1)
    shard = shard_rollout(make_samples(model_dir), backend.rollout_share(), spec.n_samples_per_prompt)
    metrics = [{k: v for k, v in world.mean(step).items() if not k.startswith("perf/")}
               for step in backend.train_rollout(shard)]
    backend.save_hf(out_dir / model_dir.name)
    return metrics


def main(out_dir: str, *model_dirs: str) -> None:
    from services.trainer.api.config import TrainerConfig
    from services.trainer.distributed.parallel import init_world
    from services.trainer.ranks.rank_exit import exit_rank

    config = TrainerConfig()
    world = init_world(rank=config.rank, world_size=config.world_size, master_addr=config.master_addr,
                       master_port=config.master_port, timeout_s=120)
    results = {Path(d).name: train(Path(d), Path(out_dir), world) for d in model_dirs}
    if world.rank == 0:
        (Path(out_dir) / "metrics.json").write_text(json.dumps(results))
    exit_rank(0, world)


if __name__ == "__main__":
    main(*sys.argv[1:])
