"""Packed against padded micro-batches for test_packing_parity, on both backends, in a world of one and of two
data-parallel ranks (gloo): per-token log-probs and entropy, one training step's metrics and its full gradients,
with each rank's micro-batches (how many, how many tokens).

Run: python -m tests.integration.packing_worker MODEL_DIR OUT_DIR  (writes OUT_DIR/results-1.json, results-2.json)
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from bench.megatron_parity import spawn
from services.common.samples import Sample

# (prompt, response) token counts: the first rank's FSDP share is long and packs into four micro-batches under
# the budget of 20 tokens, the second's short one into one, which it halves until it runs four too.
LENGTHS = [(6, 10), (5, 9), (7, 8), (4, 6), (3, 2), (4, 1), (3, 3), (2, 2)]
CONFIGS = {  # every policy-loss term live on a token budget; SFT on fixed micro-batches
    "grpo_dynamic": {"n_samples_per_prompt": 2, "use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01,
                     "use_tis": True, "use_dynamic_batch_size": True, "max_tokens_per_gpu": 20},
    "sft_fixed": {"n_samples_per_prompt": 2, "loss_type": "sft_loss", "micro_batch_size": 3},
}


def rollout(vocab_size: int, pad_token_id: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    samples = []
    for i, (prompt, response) in enumerate(LENGTHS):
        tokens = torch.randint(0, vocab_size - 1, (prompt + response,), generator=gen)
        tokens = (tokens + (tokens >= pad_token_id).long()).tolist()  # no pad token among the inputs
        samples.append(Sample(tokens=tokens, response_length=response, reward=float(i % 3 == 0),
                              rollout_log_probs=(-0.5 - torch.rand(response, generator=gen)).tolist()))
    samples[1].loss_mask = [1, 0] + [1] * (LENGTHS[1][1] - 2)
    return samples


def fsdp_probe(model_dir: Path, config, world, samples: list[Sample], packed: bool) -> dict:
    from torch.distributed.tensor import DTensor

    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.batching.batch import build_rollout_batch
    from services.trainer.distributed.parallel import shard_rollout

    backend = TorchBackend(model_dir, config, world=world, pack_sequences=packed, min_padding_to_pack=0.0)
    share = shard_rollout(samples, backend.rollout_share(), config.n_samples_per_prompt)
    batch = build_rollout_batch(share, pad_token_id=backend.pad_token_id)
    (micro,) = backend._schedule(batch, None)
    stats = [backend._recompute(lambda mb, i=i: backend._token_stats(backend._logits(backend.model, mb), mb)[i],
                                batch, micro) for i in (0, 1)]
    (metrics,) = backend.train_rollout(share)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in backend.model.named_parameters()}
    lengths = batch.total_lengths
    return {"log_probs": stats[0], "entropy": stats[1], "metrics": metrics, "grads": grads,
            "micro_batches": [[sum(lengths[i] for i in mb) for mb in micro]],
            "response_lengths": batch.response_lengths}


def megatron_probe(model_dir: Path, config, samples: list[Sample], packed: bool) -> dict:
    from services.trainer.backends.megatron.backend import MegatronBackend
    from services.trainer.batching.batch import build_rollout_batch

    backend = MegatronBackend(model_dir, config, use_distributed_optimizer=False, pack_sequences=packed,
                              min_padding_to_pack=0.0)
    batch = build_rollout_batch(samples, pad_token_id=backend.pad_token_id)
    micro = backend._micro_batches(batch, list(range(batch.size)))
    stats = torch.zeros(2, *batch.loss_masks.shape)

    def store(rows, mb, logits):
        log_probs, entropy = backend._token_stats(logits, mb)
        stats[0, rows, :log_probs.shape[1]] = log_probs.cpu()
        stats[1, rows, :entropy.shape[1]] = entropy.cpu()
        return log_probs.sum() * 0.0

    backend._run(backend.model, batch, micro, store, forward_only=True)
    dist.all_reduce(stats)  # TP = PP = 1: each row on exactly one rank
    (metrics,) = backend.train_rollout(samples)
    grads = {name: p.main_grad.clone() for name, p in backend.gpt.named_parameters()}  # all-reduced over DP
    lengths = batch.total_lengths
    mine = [sum(lengths[i] for i in mb) for mb in micro]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    backend.close()
    return {"log_probs": stats[0], "entropy": stats[1], "metrics": metrics, "grads": grads, "micro_batches": every,
            "response_lengths": batch.response_lengths}


def max_diffs(padded: dict, packed: dict) -> dict:
    """Packed against padded: max |difference| of each per-token statistic (on response tokens), metric and grad."""
    lengths = padded["response_lengths"]
    valid = torch.arange(padded["log_probs"].shape[1]) < lengths.unsqueeze(-1)
    out = {key: float((packed[key] - padded[key])[valid].abs().max()) for key in ("log_probs", "entropy")}
    out["metrics"] = {key: abs(packed["metrics"][key] - value) for key, value in padded["metrics"].items()
                      if not key.startswith("perf/")}
    out["grads"] = max(float((packed["grads"][n] - g).abs().max()) for n, g in padded["grads"].items())
    out["grad_scale"] = max(float(g.abs().max()) for g in padded["grads"].values())
    return out


def run(rank: int, world_size: int, model_dir: Path, out_dir: Path) -> None:
    from services.trainer.distributed.parallel import World
    from services.trainer.settings.train import TrainConfig

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    dist.init_process_group("gloo")
    world = World(rank=rank, world_size=world_size)
    results: dict = {}
    for name, overrides in CONFIGS.items():
        config = TrainConfig(**overrides, lr=1e-3, clip_grad=0.0)
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        pad = json.loads((model_dir / "config.json").read_text()).get("pad_token_id") or 0
        samples = rollout(vocab_size, pad)
        fsdp = [fsdp_probe(model_dir, config, world, samples, packed) for packed in (False, True)]
        megatron = [megatron_probe(model_dir, config, samples, packed) for packed in (False, True)]
        every_fsdp = [None] * world_size
        dist.all_gather_object(every_fsdp, {"diffs": max_diffs(*fsdp), "micro_batches": fsdp[1]["micro_batches"][0]})
        results[name] = {
            "fsdp": {"diffs": [part["diffs"] for part in every_fsdp],
                     "micro_batches": [part["micro_batches"] for part in every_fsdp]},
            "megatron": {"diffs": [max_diffs(*megatron)], "micro_batches": megatron[1]["micro_batches"]}}
    if rank == 0:
        (out_dir / f"results-{world_size}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)  # no OpenMP pool before the fork
    # Imported once here; the forked ranks inherit them.
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers  # noqa: F401

    import services.trainer.backends.fsdp  # noqa: F401
    import services.trainer.backends.megatron.backend  # noqa: F401

    model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    start = "spawn" if torch.cuda.is_available() else "fork"
    for size in (1, 2):
        spawn(run, model_dir, out_dir, world_size=size, start_method=start)
