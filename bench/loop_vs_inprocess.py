"""GRPO steps/s of the whole service loop against an in-process loop (same model, same batch, HF generate + the same
loss and optimizer, no services), and where a step of the service loop goes.

`python bench/loop_vs_inprocess.py [--rollouts 12]`. The job is the demo's GRPO job (examples/demo/job.yaml: 64
prompts x 8 samples, global batch 512, 4 response tokens) on the demo's model. The service side runs on the local
stack (`make demo`'s: 2 engines, 1 trainer rank with 2 threads); the in-process side is bench/inprocess_loop.py with
2 threads, run before and after the service side (their mean counts, so a drift in other load falls on both). The
first --warmup rollouts of each side are left out. Prints the ratio, the trainer's step time breakdown (generate
wait, log-prob recompute, forward/backward, optimizer, weight sync, the rest of the period), then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, print_table, run_job  # noqa: E402
from bench.inprocess_loop import InProcessLoop  # noqa: E402
from physarum import stack, tasks, tinymodel  # noqa: E402
from physarum.cli import load_job_file  # noqa: E402

JOB = Path(__file__).resolve().parents[1] / "examples/demo/job.yaml"
BREAKDOWN = (("generate wait", "perf/rollout_seconds"), ("log-prob recompute", "perf/log_probs_seconds"),
             ("forward/backward", "perf/forward_backward_seconds"), ("optimizer", "perf/optimizer_seconds"),
             ("weight sync", "perf/update_weights_seconds"))


def job_spec(model: Path, data: Path, num_rollout: int) -> dict:
    return {**load_job_file(JOB, []), "job_id": f"bench-loop-{time.time_ns()}", "hf_checkpoint": str(model),
            "prompt_data": str(data), "num_rollout": num_rollout}


def in_process_seconds(spec: dict, warmup: int) -> float:
    """Seconds per rollout in steady state."""
    loop = InProcessLoop(spec, num_threads=2)
    for _ in range(warmup):
        loop.step()
    start = time.perf_counter()
    for _ in range(spec["num_rollout"] - warmup):
        loop.step()
    return (time.perf_counter() - start) / (spec["num_rollout"] - warmup)


def service_rollouts(state: dict, spec: dict, timeout_s: float = 1800.0) -> list[dict]:
    """Submit, wait, and return the job's per-rollout events (with metrics) in order."""
    return [e for e in run_job(state["trainer_url"], spec, timeout_s) if "rollout/reward_mean" in e["metrics"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rollouts", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-loop-"))
    model = tinymodel.build_tiny_model(work / "model", tasks.corpus())
    train, _ = tasks.write_addition_task(work / "task")
    spec = job_spec(model, train, args.rollouts)
    steps_per_rollout = spec["rollout_batch_size"] * spec["n_samples_per_prompt"] // spec["global_batch_size"]
    local_s = [in_process_seconds(spec, args.warmup)]
    state = stack.up(stack.StackOptions(work_dir=work / "stack", model_path=model, num_engines=2, trainer_threads=2))
    try:
        events = service_rollouts(state, job_spec(model, train, args.rollouts))[args.warmup:]
    finally:
        stack.down(work / "stack")
    local_s.append(in_process_seconds(spec, args.warmup))
    periods = [b["time"] - a["time"] for a, b in zip(events, events[1:], strict=False)]
    service_s, local = statistics.median(periods), statistics.fmean(local_s)
    ratio = local / service_s
    print_table(f"GRPO loop, demo job ({steps_per_rollout} optimizer steps per rollout), steady state",
                ["loop", "s per rollout", "steps/s", "vs in-process (goal >= 0.5)"],
                [["in-process (HF generate, same backend)", f"{local:.3f}", steps_per_rollout / local, 1.0],
                 ["service loop (median period)", f"{service_s:.3f}", steps_per_rollout / service_s, ratio]])
    rows, accounted = [], 0.0
    for label, key in BREAKDOWN:
        values = [e["metrics"].get(key, 0.0) * (steps_per_rollout if "backward" in key or "optimizer" in key else 1)
                  for e in events[1:]]
        seconds = statistics.median(values)
        accounted += seconds
        rows.append([label, f"{seconds:.3f}", seconds / service_s])
    idle = service_s - accounted
    rows.append(["idle / other (period - the above)", f"{idle:.3f}", idle / service_s])
    print_table("trainer step time breakdown, per rollout (medians)", ["phase", "seconds", "share of the period"],
                rows)
    emit({"loop_vs_inprocess": ratio, "loop_service_s_per_rollout": service_s, "loop_inprocess_s_per_rollout": local,
          "step_breakdown_s": {label: float(row[1]) for label, row in zip([r[0] for r in rows], rows, strict=True)}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
