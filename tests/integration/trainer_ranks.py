"""One trainer rank of the data- and context-parallel parity test: `python -m tests.integration.trainer_ranks OUT
MODEL` with torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. The test runs the same cases in one process
(`run_cases` with a single-rank World) and compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from services.common.samples import Sample
from tests.tiny_samples import samples_of

# (prompt, response, reward) in groups of n = 2: a rollout of 8 samples, two optimizer steps of 4.
ROLLOUT = [("1+2=", "3", 1.0), ("1+2=", "4", 0.0), ("12+34=", "46", 1.0), ("12+34=", "55", 0.0),
           ("7+8=", "15", 0.0), ("7+8=", "16", 1.0), ("30+4=", "34", 1.0), ("30+4=", "3", 0.0)]
BASE = {"hf_checkpoint": "", "prompt_data": "unused.jsonl", "num_rollout": 3, "rollout_batch_size": 4,
        "n_samples_per_prompt": 2, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-3, "weight_decay": 0.0,
        "lr_decay_style": "linear", "lr_warmup_iters": 1, "clip_grad": 0.5}
CASES = {
    "grpo": {},
    "per_token_kl": {"calculate_per_token_loss": True, "use_kl_loss": True, "kl_loss_coef": 0.1,
                     "entropy_coef": 0.01, "ref_update_interval": 1},
    # LoRA adapters on a frozen base sharded by FSDP2; the KL reference is the base (the adapters off)
    "lora": {"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2, "use_kl_loss": True, "kl_loss_coef": 0.1},
    "bf16": {"bf16": True},  # FSDP2's mixed-precision policy over two ranks, autocast in one process
    # both ranks split every sequence (one context-parallel group, one data-parallel share); one process: CP 1
    "context_parallel": {"context_parallel_size": 2, "micro_batch_size": 2, "use_kl_loss": True,
                         "kl_loss_coef": 0.1, "ref_update_interval": 1},
}
NUM_ROLLOUTS = 2


def make_samples(model_dir: Path) -> list[Sample]:
    out = samples_of(model_dir, ROLLOUT)
    for i, sample in enumerate(out):
        sample.loss_mask = [1] * sample.response_length
        sample.group_index, sample.index = i // 2, i % 2
    out[2].loss_mask[1] = 0  # a masked token in the middle
    return out


def run_case(name: str, model_dir: Path, out_dir: Path, world):
    """Train NUM_ROLLOUTS rollouts of the case; export HF and a iterations. Returns per rollout, per step, the
    metrics averaged over the ranks, and the backend."""
    from services.trainer.api.spec import parse_spec
    from services.trainer.checkpoint import iterations
    from services.trainer.distributed.parallel import shard_rollout
    from services.trainer.driver.loop import make_backend

    layout = {} if world.distributed else {"context_parallel_size": 1}
    spec = parse_spec({**BASE, **CASES[name], **layout, "hf_checkpoint": str(model_dir)})
    backend = make_backend(spec, world, num_threads=1)
    samples = make_samples(model_dir)
    metrics = []
    for _ in range(NUM_ROLLOUTS):
        shard = shard_rollout(samples, backend.rollout_share(), spec.n_samples_per_prompt)
        # perf/ keys are timings, not results: the runs compare what they train
        metrics.append([{k: v for k, v in world.mean(step).items() if not k.startswith("perf/")}
                        for step in backend.train_rollout(shard)])
        if spec.ref_update_interval:
            backend.update_ref_model()
    backend.save_hf(out_dir / name / "hf")
    iterations.save_checkpoint(out_dir / name / "ckpt", NUM_ROLLOUTS - 1, backend, world,
                                lambda: iterations.TrainerState(NUM_ROLLOUTS - 1, name, world.world_size))
    return metrics, backend


def main(out_dir: str, model_dir: str, *cases: str) -> None:
    """Every case, or the named ones."""
    from services.trainer.api.config import TrainerConfig
    from services.trainer.distributed.parallel import init_world
    from services.trainer.ranks.rank_exit import exit_rank

    config = TrainerConfig()
    world = init_world(rank=config.rank, world_size=config.world_size, master_addr=config.master_addr,
                       master_port=config.master_port, timeout_s=120)
    results = {name: run_case(name, Path(model_dir), Path(out_dir), world)[0] for name in cases or CASES}
    if world.rank == 0:
        (Path(out_dir) / "metrics.json").write_text(json.dumps(results))
    exit_rank(0, world)


if __name__ == "__main__":
    main(*sys.argv[1:])
