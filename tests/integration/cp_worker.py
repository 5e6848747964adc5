"""One rank of test_context_parallel: `python -m tests.integration.cp_worker MODEL_DIR OUT_DIR` with torchrun's
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (a world of two). Both ranks train the fsdp backend with
context_parallel_size 2 on packed micro-batches of unequal sequences (each split over the two ranks); then rank 0
trains the same rollout alone (context parallelism 1) and writes, per case, the max |difference| of the per-token
log-probs and entropy, the step's metrics and every parameter's gradient, with each rank's micro-batch tokens.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import torch

from tests.integration.packing_worker import rollout

CASES = {  # every policy-loss term live, on a token budget (per CP rank); SFT on fixed micro-batches; PPO's critic
    "grpo_dynamic": {"n_samples_per_prompt": 2, "use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01,
                     "use_tis": True, "normalize_advantages": True, "use_dynamic_batch_size": True,
                     "max_tokens_per_gpu": 10},
    "sft_fixed": {"n_samples_per_prompt": 2, "loss_type": "sft_loss", "micro_batch_size": 3},
    "ppo": {"n_samples_per_prompt": 2, "advantage_estimator": "ppo", "micro_batch_size": 4},
}


def probe(model_dir: Path, config, world, cp_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.batching.batch import build_rollout_batch

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).clone()

    backend = TorchBackend(model_dir, config, world=world, context_parallel_size=cp_size)
    samples = rollout(backend.model.config.vocab_size, backend.pad_token_id)
    batch = build_rollout_batch(samples, pad_token_id=backend.pad_token_id)
    (micro,) = backend._schedule(batch, None)
    stats = [backend._recompute(lambda mb, i=i: backend._model_stats(backend.model, mb, with_entropy=True)[i],
                                batch, micro)
             for i in (0, 1)]
    (metrics,) = backend.train_rollout(samples)
    grads = {name: full(p.grad) for name, p in backend.model.named_parameters()}
    if backend.critic is not None:
        grads.update({f"critic.{name}": full(p.grad) for name, p in backend.critic.model.named_parameters()})
    lengths = batch.total_lengths
    return {"log_probs": stats[0], "entropy": stats[1], "metrics": metrics, "grads": grads,
            "micro_batches": [sum(lengths[i] for i in mb) for mb in micro], "response_lengths": batch.response_lengths}


def diffs(one: dict, cp: dict) -> dict:
    valid = torch.arange(one["log_probs"].shape[1]) < one["response_lengths"].unsqueeze(-1)
    out = {key: float((cp[key] - one[key])[valid].abs().max()) for key in ("log_probs", "entropy")}
    out["metrics"] = {key: abs(cp["metrics"][key] - value) for key, value in one["metrics"].items()
                      if not key.startswith("perf/")}
    out["grads"] = {name: float((cp["grads"][name] - g).abs().max()) for name, g in one["grads"].items()}
    out["grad_scale"] = max(float(g.abs().max()) for g in one["grads"].values())
    out["micro_batches"] = [one["micro_batches"], cp["micro_batches"]]
    return out


def main(model_dir: Path, out_dir: Path) -> None:
    from services.trainer.api.config import TrainerConfig
    from services.trainer.distributed.parallel import World, init_world
    from services.trainer.ranks.rank_exit import exit_rank
    from services.trainer.settings.train import TrainConfig

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    env = TrainerConfig()
    world = init_world(rank=env.rank, world_size=env.world_size, master_addr=env.master_addr,
                       master_port=env.master_port, timeout_s=300)
    results = {}
    for name, overrides in CASES.items():
        config = TrainConfig(**overrides, lr=1e-3, clip_grad=0.0)
        cp = probe(model_dir, config, world, cp_size=2)
        if world.rank == 0:  # context parallelism 1: the same rollout on this rank alone
            results[name] = diffs(probe(model_dir, config, World(), cp_size=1), cp)
        world.barrier()
    if world.rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results))
    exit_rank(0, world)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
