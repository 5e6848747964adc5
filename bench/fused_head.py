"""The fused log-probs' forward and backward with the last chunk's softmax kept for the backward (the default)
against recomputing every chunk, side by side in one process on CPU: CPU seconds per call, rounds interleaved.

Prints a table, then one JSON line: {"shapes": [{"tokens", "hidden", "vocab", "keep_ms", "recompute_ms",
"recompute_over_keep"}, ...]}. A micro-batch within one chunk (log_probs_chunk_size) is projected onto the
vocabulary once instead of twice.

Run: python -m bench.fused_head [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from services.trainer.algorithms.fused_log_probs import fused_log_probs_and_entropy

# (tokens, hidden, vocab): bench/trainer_throughput.py's CPU micro-batch of responses, then a larger vocabulary
SHAPES = [(384, 256, 4096), (1024, 256, 16384)]


def one_call(h0: torch.Tensor, w0: torch.Tensor, targets: torch.Tensor, keep: bool) -> float:
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    start = time.process_time()
    log_probs, _ = fused_log_probs_and_entropy(h, w, targets, chunk_size=1024, entropy_grad=False,
                                               keep_last_chunk=keep)
    log_probs.sum().backward()
    return time.process_time() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"{'tokens':>7} {'hidden':>7} {'vocab':>7} {'keep ms':>9} {'recompute ms':>13} {'ratio':>6}")
    for tokens, hidden, vocab in SHAPES:
        gen = torch.Generator().manual_seed(0)
        h0, w0 = torch.randn(tokens, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen) * 0.05
        targets = torch.randint(0, vocab, (tokens,), generator=gen)
        seconds: dict[bool, list[float]] = {True: [], False: []}
        for round_index in range(args.rounds + 1):
            for keep in (True, False):
                took = one_call(h0, w0, targets, keep)
                if round_index:
                    seconds[keep].append(took)
        keep_ms, recompute_ms = (statistics.median(seconds[k]) * 1e3 for k in (True, False))
        rows.append({"tokens": tokens, "hidden": hidden, "vocab": vocab, "keep_ms": round(keep_ms, 2),
                     "recompute_ms": round(recompute_ms, 2), "recompute_over_keep": round(recompute_ms / keep_ms, 3)})
        print(f"{tokens:>7} {hidden:>7} {vocab:>7} {keep_ms:>9.1f} {recompute_ms:>13.1f} "
              f"{recompute_ms / keep_ms:>6.2f}")
    result = {"shapes": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
