"""The CPU attention of bench/trainer_throughput.py's long tail, forward and backward over its model's layers: the
packed rows in query tiles (`varlen.CPU_QUERY_TILE`, as the trainer runs them: the CPU flash kernel called directly,
one autograd node a row), the same tiles as attention calls autograd records one by one (the path under dropout),
the same rows in one causal call per sequence, and the padded micro-batches under a padding mask (as HF's sdpa runs
them), side by side in one process, rounds interleaved: CPU seconds per step on one thread, wall seconds on more
(`--threads`; CPU time would add up the threads' work).

Prints a table, then one JSON line: {"tiles_ms", "recorded_tiles_ms", "per_sequence_ms", "padded_ms",
"recorded_over_tiles", "per_sequence_over_tiles", "padded_over_tiles", "tile", "threads"}.

Run: python -m bench.varlen_attention [--rounds N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.trainer_throughput import SHAPES, long_tailed_samples, measure, packed_budget
from services.trainer.batching import varlen
from services.trainer.batching.schedule import step_schedule


def _micro_batches(packed: bool) -> list[list[int]]:
    """The sequence lengths of each long-tail micro-batch: packed rows of at most micro_batch_size × the longest
    sample's tokens, or micro_batch_size samples padded to their longest (the bench's two layouts)."""
    shape = SHAPES["cpu"]
    lengths = [len(s.tokens) for s in long_tailed_samples(shape, shape["model"]["vocab_size"])]
    (step,) = step_schedule(lengths, global_batch_size=len(lengths), micro_batch_size=shape["micro_batch_size"],
                            max_tokens_per_gpu=packed_budget(shape) if packed else None)
    return [[lengths[i] for i in mb] for mb in step]


def _qkv(num_tokens: int, model: dict, gen: torch.Generator, batch: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """query, key, value: [*batch, tokens, heads or groups, head_dim], leaves that take gradients."""
    heads, groups, head_dim = model["num_attention_heads"], model["num_key_value_heads"], model["head_dim"]
    return [torch.randn(*batch, num_tokens, n, head_dim, generator=gen).requires_grad_()
            for n in (heads, groups, groups)]


def packed_step(tile: int, recorded: bool = False) -> Callable[[], None]:
    """Each packed row's attention, forward and backward, once per layer; tile at least the longest sequence: one
    call per sequence; recorded: each tile an attention call autograd records."""
    model = SHAPES["cpu"]["model"]
    gen = torch.Generator().manual_seed(0)
    rows = [(lengths, _qkv(sum(lengths), model, gen)) for lengths in _micro_batches(packed=True)]

    def step() -> None:
        for lengths, (q, k, v) in rows:
            for _ in range(model["num_hidden_layers"]):
                if recorded:
                    out = varlen._recorded_tiles(q, k, v, lengths, scale=None, dropout_p=0.0, tile=tile)
                else:
                    out = varlen.tiled_causal_attention(q, k, v, lengths, tile=tile)
                out.sum().backward()

    return step


def padded_step() -> Callable[[], None]:
    """Each padded micro-batch's attention under its causal and padding mask, forward and backward, once per layer."""
    model = SHAPES["cpu"]["model"]
    gen = torch.Generator().manual_seed(0)
    batches = []
    for lengths in _micro_batches(packed=False):
        longest = max(lengths)
        positions = torch.arange(longest)
        mask = (positions[None, :] <= positions[:, None]) & (positions < torch.tensor(lengths)[:, None, None])
        batches.append((mask[:, None], _qkv(longest, model, gen, (len(lengths),))))

    def step() -> None:
        for mask, (q, k, v) in batches:
            for _ in range(model["num_hidden_layers"]):
                F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask,
                                               enable_gqa=True).sum().backward()

    return step


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the trainer bench's CPU default: 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    longest = max(max(lengths) for lengths in _micro_batches(packed=True))
    steps = {"tiles": packed_step(varlen.CPU_QUERY_TILE),
             "recorded_tiles": packed_step(varlen.CPU_QUERY_TILE, recorded=True), "per_sequence": packed_step(longest),
             "padded": padded_step()}
    ms = {name: value * 1e3 for name, value in measure(steps, args.rounds, torch.device("cpu"), clock).items()}
    print(f"{'run':<14} {'ms/step':>8} {'vs tiles':>9}")
    for name, value in ms.items():
        print(f"{name:<14} {value:>8.1f} {value / ms['tiles']:>9.2f}")
    result = {f"{name}_ms": round(value, 2) for name, value in ms.items()}
    result.update(recorded_over_tiles=round(ms["recorded_tiles"] / ms["tiles"], 3),
                  per_sequence_over_tiles=round(ms["per_sequence"] / ms["tiles"], 3),
                  padded_over_tiles=round(ms["padded"] / ms["tiles"], 3), tile=varlen.CPU_QUERY_TILE,
                  threads=args.threads)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
