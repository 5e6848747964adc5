"""The trainer's torch threads on a shared machine: the demo's SFT warm-up rollout (512 samples, 8 optimizer steps of
64) with 1 and with 2 threads, side by side in one process, rounds interleaved, for each tiny family asked.

On an idle machine two threads can be a little faster; on one busy with other work (load average above the cores)
each parallel op waits for both threads to be scheduled, and one thread is many times faster in wall time and in CPU
time. The table prints the load average it ran under (`demo --trainer-threads` chooses).

Prints a table, then one JSON line: {"load_average", "<family>_two_vs_one_thread": wall time of a rollout with 2
threads over 1 (median over rounds; above 1 means one thread is faster), "<family>_cpu_two_vs_one_thread": the same
for CPU seconds}.

Run: python -m bench.trainer_threads [--families qwen3,qwen3_moe,qwen3_5] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, machine, median, print_table  # noqa: E402
from bench.inprocess_loop import InProcessLoop  # noqa: E402
from physarum import tasks, tinymodel  # noqa: E402
from physarum.cli import load_job_file  # noqa: E402

SFT_JOB = Path(__file__).resolve().parents[1] / "examples/demo/sft.yaml"
THREADS = (1, 2)


def sft_loop(family: str, work: Path) -> InProcessLoop:
    """The demo's SFT job on a tiny `family` model, in this process."""
    model = tinymodel.build_tiny_model(work / f"model-{family}", tasks.corpus(), family=family)
    train, _ = tasks.write_addition_task(work / "task")
    spec = {**load_job_file(SFT_JOB, []), "prompt_data": str(train.parent / "sft.jsonl"), "hf_checkpoint": str(model)}
    spec.pop("save_hf")
    return InProcessLoop(spec, num_threads=THREADS[0])


def timed_rollout(loop: InProcessLoop, threads: int) -> tuple[float, float]:
    """(wall s, CPU s) of one SFT rollout with `threads` torch threads."""
    import torch

    torch.set_num_threads(threads)
    wall, cpu = time.perf_counter(), time.process_time()
    loop.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen3,qwen3_moe,qwen3_5")
    parser.add_argument("--rounds", type=int, default=3, help="timed rollouts per thread count (after one warm-up)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-trainer-threads-"))
    load_before = os.getloadavg()[0]
    rows, figures = [], {}
    for family in args.families.split(","):
        loop = sft_loop(family, work)
        timed_rollout(loop, THREADS[-1])  # warm-up: the first step allocates the optimizer's state
        times: dict[int, list[tuple[float, float]]] = {threads: [] for threads in THREADS}
        for _ in range(args.rounds):
            for threads in THREADS:
                times[threads].append(timed_rollout(loop, threads))
        wall = {threads: median([w for w, _ in times[threads]]) for threads in THREADS}
        cpu = {threads: median([c for _, c in times[threads]]) for threads in THREADS}
        rows.append([family, wall[1], cpu[1], wall[2], cpu[2], wall[2] / wall[1], cpu[2] / cpu[1]])
        figures[f"{family}_two_vs_one_thread"] = round(wall[2] / wall[1], 3)
        figures[f"{family}_cpu_two_vs_one_thread"] = round(cpu[2] / cpu[1], 3)
    load = (load_before + os.getloadavg()[0]) / 2
    print(f"{machine()}")
    print_table(f"The demo's SFT rollout (512 samples, 8 steps of 64), median of {args.rounds}; load average "
                f"{load:.1f} on {os.cpu_count()} cores", ["family", "1 thread wall s", "1 thread CPU s",
                                                          "2 threads wall s", "2 threads CPU s", "wall 2/1", "CPU 2/1"],
                rows)
    emit({"load_average": round(load, 2), **figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
