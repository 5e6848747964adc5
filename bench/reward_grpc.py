"""Reward scoring over gRPC against the same scorer called in-process: samples/s, 256 samples per call.

`python bench/reward_grpc.py [--calls 20]`. The reward service runs as a process; the in-process side calls
`score_samples` (what the servicer calls) in this process. Both sides alternate, call by call, so other load on the
machine falls on both alike. Prints a table, then one JSON line (`reward_grpc_vs_inprocess`, for exact_match).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, median, print_table, start_grpc_service  # noqa: E402
from services.common.samples import Sample  # noqa: E402
from services.reward.client import RewardClient  # noqa: E402
from services.reward.scorers import score_samples  # noqa: E402


def make_samples(num_samples: int) -> list[Sample]:
    """Demo-like samples: a two-digit sum, half of them right, with their tokens and log-probs."""
    return [Sample(prompt=f"{i % 100}+{i % 37}=", response=str(i % 100 + i % 37 + i % 2), label=str(i % 100 + i % 37),
                   tokens=list(range(10)), response_length=4, rollout_log_probs=[-0.5] * 4, index=i)
            for i in range(num_samples)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20, help="calls per side and scorer")
    parser.add_argument("--samples-per-call", type=int, default=256)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-reward-"))
    samples = make_samples(args.samples_per_call)
    proc, addr = start_grpc_service(work, "services.reward", "--rest-port", "0")
    rows, figures = [], {}
    try:
        with RewardClient(addr, timeout_s=60.0) as client:
            for rm_type in ("exact_match", "math"):
                local_s, remote_s = [], []
                for _ in range(args.calls + 1):  # the first pair warms both up and is left out
                    start = time.perf_counter()
                    asyncio.run(score_samples(samples, rm_type=rm_type, custom_rm_path="", reward_key="",
                                              timeout_s=10.0, args={}))
                    local_s.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    client.score(samples, rm_type=rm_type, timeout_s=10.0)
                    remote_s.append(time.perf_counter() - start)
                local, remote = median(local_s[1:]), median(remote_s[1:])
                ratio = local / remote
                rows.append([rm_type, args.samples_per_call / local, args.samples_per_call / remote, ratio])
                figures[rm_type] = ratio
    finally:
        proc.stop()
    print_table(f"reward scoring, {args.samples_per_call} samples per call (median of {args.calls} calls)",
                ["rm_type", "in-process samples/s", "gRPC samples/s", "gRPC / in-process (goal >= 0.8)"], rows)
    emit({"reward_grpc_vs_inprocess": figures["exact_match"], "reward_grpc_vs_inprocess_math": figures["math"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
