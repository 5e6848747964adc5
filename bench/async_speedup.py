"""Async training speedup: the same GRPO job in `sync`, `one_step_async` and `fully_async` on one local
stack, with a rollout's generation time calibrated to about the trainer's time per rollout.

Run: .venv/bin/python bench/async_speedup.py [--rounds 2] [--num-rollout 8] [--response-len N] [--json PATH]
(about 5 minutes on 2 cores).
Prints, per mode, steps per minute and their ratio to sync, where a rollout's time goes, the engines' pause per
weight sync, staleness and regenerated groups; then Redis memory per 1,000 stored groups. Last line:
`async_speedup=<fully_async steps/min ÷ sync steps/min>` (the goal: >= 1.8).

How rollout time ≈ train time is reached: the engines are latency-controlled (StackOptions.engine_per_token_delay_s:
every decode step of a CPU engine sleeps that long) with the delay fixed when the stack starts; the knob is then
rollout_max_response_len. The job has no ignore_eos, but the random tiny model seldom samples EOS and an engine batch
lasts as long as its longest request, so generation time grows about linearly with that length. Calibration runs
short sync jobs (--calibration-rollouts each, rollout 0 left out) and sets length <- length x train_s / rollout_s
until the two are within 15% (--calibration-rounds at most); --response-len skips it. Training time moves with the
machine's other load, so the sync jobs may still find the two apart: the "overlap bound" line is what overlapping
can give with the sync jobs' phase times, (rollout + train + sync) / max(rollout, train + sync), 2x only when they
match. (Re-running sync with a corrected length made it worse: it chased a burst of other load.)

Why a long delay (0.2 s) and short responses: on a 2-core machine whatever CPU generation uses during training is
taken from training. Each decode step still runs the model, so the engines' CPU grows with the number of decode
steps: at 0.05 s per step (~30 tokens) they used ~1.4 CPU-s per rollout and the overlapped training slowed by 45-75%
(async_speedup 1.1-1.4); at 0.2 s (~8 tokens), ~0.5 CPU-s. The model is a 4-layer, 256-wide tiny Qwen3 so that
training, not per-request overhead, is most of the trainer's work; the trainer gets --trainer-threads (default 1)
torch threads, so the engines, the manager, the buffer and Redis keep a core. The CPU table (seconds per rollout by
process, and the machine's 1-minute load average) shows whether that held: other work on the machine slows
training, and more so in the async modes, where generation runs alongside.

Each mode runs --rounds jobs (default 2) in alternating order (sync, one_step_async, fully_async, then the reverse),
so a drift in the machine's other load falls on every mode alike. Steps per minute are counted in steady state: the
first --warmup rollouts of each job (default 2: model load, the first weight push, and the async modes' first
rollout, which nothing overlaps) are left out. A rollout's period is the time between the job's reports of it and of
the one before; the table shows medians over a mode's steady rollouts (a burst of other work on a shared machine
slows a rollout or two; the mean-based rates are printed below it).
"rollout wait s" is the trainer's wait for its samples (one_step_async: for the next rollout before the weight
push); "other s" is the period minus the rollout wait, training and the weight sync: what the driver does serially
besides them. "pause/sync s" is the engines' mean pause per weight sync (pause_generation to continue_generation);
while the engines generate (async modes) it includes waiting for the running decode step to end, up to one
per-token delay.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import run_job  # noqa: E402
from physarum import cputime, stack, tasks, tinymodel  # noqa: E402

MODES = ("sync", "one_step_async", "fully_async")
MAX_RESPONSE_LEN = 100  # the tiny model's context is 128 tokens; prompts ("12+34=") take ~6
TOLERANCE = 0.15  # calibration: |rollout_s / train_s - 1| below this is close enough


def job_spec(model: Path, data: Path, args: argparse.Namespace, *, job_id: str, mode: str, num_rollout: int,
             response_len: int) -> dict[str, Any]:
    """The bench's GRPO job; only job_id, mode, num_rollout and the response length vary."""
    return {"job_id": job_id, "mode": mode, "hf_checkpoint": str(model), "prompt_data": str(data),
            "num_rollout": num_rollout, "rollout_batch_size": args.rollout_batch_size,
            "n_samples_per_prompt": args.n_samples_per_prompt, "global_batch_size": args.global_batch_size,
            "rollout_max_response_len": response_len, "rm_type": "exact_match", "lr": 1e-5,
            "rollout_temperature": 1.0, "update_weights_interval": 1, "max_weight_staleness": 1,
            "weight_sync_timeout_s": 60.0, "lease_timeout_s": 60.0, "rollout_timeout_s": 300.0,
            **({"max_inflight_groups": args.max_inflight_groups} if args.max_inflight_groups else {})}


def cpu_seconds(state: dict) -> dict[str, float]:
    """CPU seconds so far of each stack process with its live descendants (the manager's engines are counted as
    "engines"), by the names in stack.json."""
    table = cputime.process_table(reaped_children=False)
    totals: dict[str, float] = {}
    for entry in state["processes"]:
        name = "trainer" if entry["name"].startswith("trainer") else entry["name"]
        for pid in cputime.tree_pids(table, [entry["pid"]]):
            kind = "engines" if name == "rollout" and pid != entry["pid"] else name
            totals[kind] = totals.get(kind, 0.0) + table[pid][1]
    return totals


def rollout_reports(events: list[dict]) -> list[dict]:
    """One event per trained rollout, in order (the driver reports each once, after its weight sync)."""
    reports = [e for e in events if "perf/train_seconds" in e["metrics"]]
    assert [e["rollout_id"] for e in reports] == list(range(len(reports))), "rollout reports out of order"
    return reports


def summarize(jobs: list[list[dict]], warmup: int, steps_per_rollout: int) -> dict[str, Any]:
    """Steady-state rate and phases of one mode: medians over rollouts warmup.. of each of its jobs (`jobs`: their
    events), pooled (see the module docstring)."""
    every, steady, intervals = [], [], []
    for events in jobs:
        reports = rollout_reports(events)
        if len(reports) <= warmup:
            raise ValueError(f"{len(reports)} rollouts leave nothing to measure after {warmup} warm-up rollouts")
        every += [e["metrics"] for e in reports]
        steady += [e["metrics"] for e in reports[warmup:]]
        times = [e["time"] for e in reports[warmup - 1:]]  # warmup >= 1
        intervals += [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    # one_step_async waits for the next rollout before the weight push (wait_next_rollout), not at its start
    waits = [m.get("perf/rollout_seconds", 0.0) + m.get("perf/wait_next_rollout_seconds", 0.0) for m in steady]
    trains = [m["perf/train_seconds"] for m in steady]
    syncs = [m.get("perf/update_weights_seconds", 0.0) for m in steady]
    others = [i - w - t - u for i, w, t, u in zip(intervals, waits, trains, syncs, strict=True)]
    pauses = [m["perf/engine_pause_seconds"] for m in steady if "perf/engine_pause_seconds" in m]
    period_s, mean_period_s = statistics.median(intervals), statistics.fmean(intervals)
    return {
        "steps_per_min": 60.0 * steps_per_rollout / period_s, "period_s": period_s,
        "steps_per_min_mean": 60.0 * steps_per_rollout / mean_period_s, "mean_period_s": mean_period_s,
        "rollout_wait_s": statistics.median(waits), "train_s": statistics.median(trains),
        "update_weights_s": statistics.median(syncs), "other_s": statistics.median(others),
        "engine_pause_s": statistics.fmean(pauses) if pauses else float("nan"), "num_syncs": len(pauses),
        "staleness_max": max(m.get("rollout/weight_staleness_max", 0.0) for m in every),
        "stale_regenerated": max(m.get("buffer/stale_regenerated", 0.0) for m in every),
        "stale_dropped": max(m.get("buffer/stale_dropped", 0.0) for m in every),
        "response_len_mean": statistics.fmean(m["rollout/response_len_mean"] for m in steady),
        "num_jobs": len(jobs), "num_measured": len(steady),
        "rollouts": [[{"time": e["time"], **{k: v for k, v in e["metrics"].items()
                                             if k.startswith(("perf/", "rollout/weight", "buffer/"))}}
                      for e in rollout_reports(events)] for events in jobs],  # for --json
    }


def calibrate(state: dict, model: Path, data: Path, args: argparse.Namespace) -> tuple[int, list[dict]]:
    """Pick rollout_max_response_len so that a sync rollout's generation takes about its training."""
    length, rounds = args.initial_response_len, []
    for i in range(args.calibration_rounds):
        spec = job_spec(model, data, args, job_id=f"bench-calibrate-{i}", mode="sync",
                        num_rollout=args.calibration_rollouts, response_len=length)
        steady = [e["metrics"] for e in rollout_reports(run_job(state["trainer_url"], spec, args.job_timeout_s))[1:]]
        rollout_s = statistics.median(m["perf/rollout_seconds"] for m in steady)
        train_s = statistics.median(m["perf/train_seconds"] for m in steady)
        rounds.append({"response_len": length, "rollout_s": rollout_s, "train_s": train_s})
        print(f"  calibration {i}: response_len {length:>3}: rollout {rollout_s:.2f} s, train {train_s:.2f} s "
              f"(ratio {rollout_s / train_s:.2f})", flush=True)
        if abs(rollout_s / train_s - 1) < TOLERANCE:
            break
        new = max(2, min(MAX_RESPONSE_LEN, round(length * train_s / rollout_s)))
        if new == length:
            break
        length = new
    else:
        # the last round's correction was not measured: take the length whose measured ratio was closest to 1
        length = min(rounds, key=lambda r: abs(r["rollout_s"] / r["train_s"] - 1))["response_len"]
    return length, rounds


def redis_bytes_per_1000_groups(state: dict, data: Path, template_job: str, template_rollout: int,
                                num_templates: int, num_groups: int) -> dict[str, float]:
    """Redis used_memory before and after storing num_groups groups for a job of their own, leased and written
    through the buffer as the manager writes them; their samples are copies of a rollout of template_job's."""
    import redis

    from services.buffer.client import BufferClient
    from services.common.samples import SampleGroup, group_id_for

    job_id = "bench-redis-memory"
    client = redis.Redis.from_url(state["redis_url"], socket_timeout=30)
    try:
        with BufferClient(state["buffer_addr"], timeout_s=60) as buffer:
            templates = buffer.get_batch(template_job, template_rollout, num_templates, timeout_s=10)
            buffer.load_dataset(job_id, str(data))
            before = client.info("memory")["used_memory"]
            prompts = buffer.lease_prompts(job_id, 0, num_groups, lease_timeout_s=600)
            if len(prompts) != num_groups:
                raise RuntimeError(f"leased {len(prompts)} prompts of {num_groups}")
            groups = [SampleGroup(group_id=group_id_for(job_id, p.epoch, p.index), job_id=job_id, rollout_id=0,
                                  prompt_index=p.index, epoch=p.epoch, samples=templates[i % len(templates)].samples,
                                  lease_id=p.lease_id)
                      for i, p in enumerate(prompts)]
            written = sum(buffer.put_groups(groups[i:i + 100]).num_written for i in range(0, len(groups), 100))
            after = client.info("memory")["used_memory"]
    finally:
        client.close()
    if written != num_groups:
        raise RuntimeError(f"stored {written} groups of {num_groups}")
    samples = [s for g in templates for s in g.samples]
    return {"bytes_per_1000_groups": (after - before) * 1000 / num_groups, "num_groups": num_groups,
            "samples_per_group": len(samples) / len(templates),
            "tokens_per_sample": statistics.fmean(len(s.tokens) for s in samples),
            "response_tokens_per_sample": statistics.fmean(s.response_length for s in samples)}


def measure(state: dict, spec: dict[str, Any], args: argparse.Namespace) -> tuple[list[dict], dict[str, float]]:
    """Run one job: its events, and the CPU seconds each stack process used meanwhile, with wall seconds and the
    machine's 1-minute load average at its end (others' work shows there)."""
    start, cpu_before = time.monotonic(), cpu_seconds(state)
    events = run_job(state["trainer_url"], spec, args.job_timeout_s)
    cpu = {name: value - cpu_before.get(name, 0.0) for name, value in cpu_seconds(state).items()}
    cpu.update(wall=time.monotonic() - start, load=os.getloadavg()[0])
    alone = summarize([events], args.warmup, steps_per_rollout(args))
    print(f"  {spec['job_id']}: {cpu['wall']:.0f} s, {alone['steps_per_min']:.1f} steps/min (rollout wait "
          f"{alone['rollout_wait_s']:.2f} s, train {alone['train_s']:.2f} s per rollout; load {cpu['load']:.1f})",
          flush=True)
    return events, cpu


def steps_per_rollout(args: argparse.Namespace) -> int:
    return args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size


def cpu_per_rollout(rows: list[dict[str, float]], num_rollout: int) -> dict[str, float]:
    """One mode's jobs: CPU and wall seconds per rollout by process, and the mean load average."""
    total = {name: sum(row.get(name, 0.0) for row in rows) / (num_rollout * len(rows)) for name in rows[0]}
    total["load"] = statistics.fmean(row["load"] for row in rows)
    return total


def print_table(results: dict[str, dict[str, Any]]) -> None:
    base = results["sync"]["steps_per_min"]
    columns = (("mode", 15), ("steps/min", 10), ("ratio", 6), ("rollout wait s", 15), ("train s", 8),
               ("weight sync s", 14), ("other s", 8), ("period s", 9), ("pause/sync s", 13), ("max stale", 10),
               ("stale regen", 12))
    print(" ".join(f"{name:>{width}}" for name, width in columns))
    for mode, r in results.items():
        cells = (mode, f"{r['steps_per_min']:.1f}", f"{r['steps_per_min'] / base:.2f}", f"{r['rollout_wait_s']:.2f}",
                 f"{r['train_s']:.2f}", f"{r['update_weights_s']:.2f}", f"{r['other_s']:.2f}",
                 f"{r['period_s']:.2f}", f"{r['engine_pause_s']:.3f}", f"{r['staleness_max']:.0f}",
                 f"{r['stale_regenerated']:.0f}")
        print(" ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns, strict=True)))


def print_cpu(cpu: dict[str, dict[str, float]]) -> None:
    """Where the machine's CPU went: seconds per rollout (whole jobs, warm-up included) by process."""
    names = ["trainer", "engines", "rollout", "router", "buffer", "redis", "reward"]  # rollout: the manager
    print(f"\nCPU seconds per rollout (whole job): {'mode':>15} "
          + " ".join(f"{'manager' if n == 'rollout' else n:>8}" for n in names)
          + f" {'all':>8} {'wall s':>8} {'load avg':>8}")
    for mode, row in cpu.items():
        total = sum(row.get(n, 0.0) for n in names)
        print(f"{'':36}{mode:>15} " + " ".join(f"{row.get(n, 0.0):8.2f}" for n in names)
              + f" {total:8.2f} {row['wall']:8.2f} {row['load']:8.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-rollout", type=int, default=8, help="rollouts per job")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per mode, in alternating order of modes")
    parser.add_argument("--warmup", type=int, default=2, help="first rollouts left out of steps/min (>= 1)")
    parser.add_argument("--response-len", type=int, help="rollout_max_response_len; skips the calibration")
    parser.add_argument("--initial-response-len", type=int, default=8, help="the calibration's first guess")
    parser.add_argument("--calibration-rounds", type=int, default=3)
    parser.add_argument("--calibration-rollouts", type=int, default=4, help="per calibration job (the first is "
                        "left out)")
    parser.add_argument("--per-token-delay-s", type=float, default=0.2, help="engine latency per decode step")
    parser.add_argument("--num-engines", type=int, default=2)
    parser.add_argument("--model-layers", type=int, default=4, help="of the tiny Qwen3 (physarum.tinymodel)")
    parser.add_argument("--model-hidden", type=int, default=256)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--rollout-batch-size", type=int, default=32)
    parser.add_argument("--n-samples-per-prompt", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--max-inflight-groups", type=int, help="fully_async (default: rollout_batch_size)")
    parser.add_argument("--redis-groups", type=int, default=1000, help="groups stored for the Redis measure")
    parser.add_argument("--job-timeout-s", type=float, default=300.0, help="per job, then it is cancelled")
    parser.add_argument("--work-dir", type=Path, help="default: a temporary directory, removed after a clean run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.num_rollout <= args.warmup:
        parser.error(f"need 1 <= --warmup < --num-rollout, got {args.warmup} and {args.num_rollout}")
    if args.calibration_rollouts < 2:
        parser.error("--calibration-rollouts must be >= 2 (the first is left out)")

    started = time.monotonic()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="physarum-async-bench-"))
    model = tinymodel.build_tiny_model(work / f"model-{args.model_layers}x{args.model_hidden}", tasks.corpus(),
                                       num_layers=args.model_layers, hidden_size=args.model_hidden)
    data, _ = tasks.write_addition_task(work / "task")
    options = stack.StackOptions(work_dir=work / "stack", model_path=model, num_engines=args.num_engines,
                                 engine_threads=1, trainer_threads=args.trainer_threads,
                                 engine_per_token_delay_s=args.per_token_delay_s)
    print(f"stack: {args.num_engines} CPU engines ({args.per_token_delay_s} s per decode step), trainer "
          f"{args.trainer_threads} thread(s); job: {args.rollout_batch_size} prompts x {args.n_samples_per_prompt} "
          f"samples, {steps_per_rollout(args)} optimizer steps per rollout; work dir {work}", flush=True)
    state = stack.up(options)
    try:
        print(f"stack up in {time.monotonic() - started:.0f} s", flush=True)
        calibration: list[dict] = []
        if args.response_len:
            length = args.response_len
        else:
            length, calibration = calibrate(state, model, data, args)
        print(f"rollout_max_response_len {length}; {args.rounds} jobs of {args.num_rollout} rollouts per mode, the "
              f"first {args.warmup} of each left out of steps/min (warm-up)", flush=True)
        sync_job = ""  # the last sync job: its groups are the Redis measure's template
        events: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
        cpu_rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for round_id in range(args.rounds):  # sync, one_step, fully, then fully, one_step, sync, ...: drift evens out
            for mode in MODES if round_id % 2 == 0 else MODES[::-1]:
                spec = job_spec(model, data, args, job_id=f"bench-{mode.replace('_', '-')}-{round_id}", mode=mode,
                                num_rollout=args.num_rollout, response_len=length)
                job_events, cpu_row = measure(state, spec, args)
                events[mode].append(job_events)
                cpu_rows[mode].append(cpu_row)
                if mode == "sync":
                    sync_job = spec["job_id"]
        memory = redis_bytes_per_1000_groups(state, data, sync_job, args.num_rollout - 1, args.rollout_batch_size,
                                             args.redis_groups)
    finally:
        stack.down(options.work_dir)

    results = {mode: summarize(events[mode], args.warmup, steps_per_rollout(args)) for mode in MODES}
    cpu = {mode: cpu_per_rollout(cpu_rows[mode], args.num_rollout) for mode in MODES}
    print()
    print_table(results)
    print_cpu(cpu)
    sync = results["sync"]
    print(f"(steady state: rollouts {args.warmup}..{args.num_rollout - 1} of {args.rounds} jobs per mode, "
          f"{sync['num_measured']} rollouts; sync rollout wait / train = "
          f"{sync['rollout_wait_s'] / sync['train_s']:.2f}; mean response length {sync['response_len_mean']:.1f} "
          f"tokens of {length})")
    print("mean-based (total time of the steady rollouts): " + ", ".join(
        f"{mode} {r['steps_per_min_mean']:.1f} steps/min ({r['steps_per_min_mean'] / sync['steps_per_min_mean']:.2f}x)"
        for mode, r in results.items()))
    bound_s = max(sync["rollout_wait_s"], sync["train_s"] + sync["update_weights_s"])
    print(f"overlap bound with these phase times: sync period / max(rollout, train + weight sync) = "
          f"{sync['period_s']:.2f} / {bound_s:.2f} = {sync['period_s'] / bound_s:.2f}x; reached: "
          + ", ".join(f"{mode} {sync['period_s'] / results[mode]['period_s']:.2f}x" for mode in MODES[1:]))
    print(f"engine pause per weight sync (mean over {sum(r['num_syncs'] for r in results.values())} syncs): "
          + ", ".join(f"{mode} {r['engine_pause_s'] * 1000:.0f} ms" for mode, r in results.items()))
    print(f"Redis memory per 1,000 stored groups: {memory['bytes_per_1000_groups'] / 2**20:.2f} MiB "
          f"({memory['bytes_per_1000_groups'] / 1000:.0f} bytes per group of {memory['samples_per_group']:.0f} "
          f"samples, {memory['tokens_per_sample']:.1f} tokens each, {memory['response_tokens_per_sample']:.1f} "
          f"generated; measured with {memory['num_groups']} groups)")
    print(f"bench took {time.monotonic() - started:.0f} s")
    speedup = results["fully_async"]["steps_per_min"] / sync["steps_per_min"]
    if args.json:
        args.json.write_text(json.dumps({"response_len": length, "calibration": calibration, "modes": results,
                                         "cpu": cpu, "redis": memory, "async_speedup": speedup}, indent=2))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    print(f"async_speedup={speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
