"""Reward scoring over gRPC against the same scorer called in-process: samples/s, 256 samples per call.

`python bench/reward_grpc.py [--calls 40]`. The reward service runs as a process; the in-process side calls
`score_samples` (what the servicer calls) in this process. The two sides take turns in pairs of calls, which of them
goes first alternating from pair to pair, so other load on the machine falls on both alike; a figure is the median
over pairs of the in-process call's seconds over the gRPC call's (a pair shares the machine's load of its moment, so
a busy spell that slows both cancels out). Then each side runs as many calls again in a block, timed by the CPU its
processes used (this one and its reward workers; this one as the client, the service and the service's workers):
`reward_grpc_vs_inprocess_cpu` is the in-process CPU per call over the gRPC one's: what the hop costs in work, apart
from waiting for a core (a busy machine still raises both, the side with more processes switching on the cores the
more). Prints a table, then one JSON line (`reward_grpc_vs_inprocess` for exact_match, `reward_grpc_vs_inprocess_math`,
`reward_grpc_vs_inprocess_cpu` for exact_match).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

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


def cpu_per_call(call: Callable[[], None], processes: list[psutil.Process], num_calls: int) -> float:
    """CPU seconds the processes' threads ran per call, over num_calls calls in a row: from the scheduler's own
    nanosecond count (/proc/PID/task/TID/schedstat), not the 10 ms ticks of user and system time."""
    def used() -> float:
        total = 0
        for process in processes:
            for thread in Path(f"/proc/{process.pid}/task").iterdir():
                try:
                    total += int((thread / "schedstat").read_text().split()[0])
                except (FileNotFoundError, ProcessLookupError):  # a thread that ended: too short-lived to count
                    pass
        return total / 1e9
    start = used()
    for _ in range(num_calls):
        call()
    return (used() - start) / num_calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=40, help="calls per side and scorer")
    parser.add_argument("--samples-per-call", type=int, default=256)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-reward-"))
    samples = make_samples(args.samples_per_call)
    proc, addr = start_grpc_service(work, "services.reward", "--rest-port", "0")
    rows, figures = [], {}
    try:
        with RewardClient(addr, timeout_s=60.0) as client:
            for rm_type in ("exact_match", "math"):
                def in_process(rm_type: str = rm_type) -> None:
                    asyncio.run(score_samples(samples, rm_type=rm_type, custom_rm_path="", reward_key="",
                                              timeout_s=10.0, args={}))

                def over_grpc(rm_type: str = rm_type) -> None:
                    client.score(samples, rm_type=rm_type, timeout_s=10.0)

                local_s, remote_s = [], []
                for call in range(args.calls + 1):  # the first pair warms both up and is left out
                    for side in ((in_process, over_grpc) if call % 2 else (over_grpc, in_process)):
                        start = time.perf_counter()
                        side()
                        (local_s if side is in_process else remote_s).append(time.perf_counter() - start)
                local_s, remote_s = local_s[1:], remote_s[1:]
                local, remote = median(local_s), median(remote_s)
                ratio = median([one / other for one, other in zip(local_s, remote_s, strict=True)])
                # the warm-up started every worker: this process's (the in-process pool) and the service's
                me, service = psutil.Process(), psutil.Process(proc.pid)
                in_process_cpu = cpu_per_call(in_process, [me, *(p for p in me.children() if p.pid != proc.pid)],
                                              args.calls)
                grpc_cpu = cpu_per_call(over_grpc, [me, service, *service.children(recursive=True)], args.calls)
                rows.append([rm_type, args.samples_per_call / local, args.samples_per_call / remote, ratio,
                             in_process_cpu * 1e3, grpc_cpu * 1e3, in_process_cpu / grpc_cpu])
                figures[rm_type] = ratio
                figures[f"{rm_type} cpu"] = in_process_cpu / grpc_cpu
    finally:
        proc.stop()
    print_table(f"reward scoring, {args.samples_per_call} samples per call (median of {args.calls} calls)",
                ["rm_type", "in-process samples/s (median)", "gRPC samples/s (median)",
                 "gRPC / in-process, median over pairs (goal >= 0.8)", "in-process CPU ms per call",
                 "gRPC CPU ms per call", "CPU: in-process / gRPC"], rows)
    emit({"reward_grpc_vs_inprocess": figures["exact_match"], "reward_grpc_vs_inprocess_math": figures["math"],
          "reward_grpc_vs_inprocess_cpu": figures["exact_match cpu"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
