"""`make bench`: run every benchmark script in bench/ one after another, with settings small enough for about 30
minutes on 2 cores, write their tables to bench/RESULTS.md with the machine's description, and end with one JSON
line holding every hop's figure under the issue's keys.

`python bench/run_all.py [--only weight_sync,reward_grpc] [--out bench/RESULTS.md]`. Each script prints its tables,
then one JSON line last; a script that fails is reported as failed and the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import machine  # noqa: E402

BENCH = Path(__file__).resolve().parent
# script -> the arguments `make bench` runs it with (the hops first, then the older benchmarks, shortened)
SCRIPTS = {
    "weight_sync": ["--rounds", "3"],
    "same_host_sync": ["--rounds", "3"],
    "engine_decode": ["--rounds", "3"],
    "router_overhead": ["--requests", "200"],
    "gateway_overhead": ["--sessions", "40"],
    "gateway_isolation": ["--rounds", "3"],
    "buffer_vs_redis": ["--rounds", "10"],
    "redis_appendfsync": ["--rounds", "10"],
    "reward_grpc": ["--calls", "20"],
    "loop_vs_inprocess": ["--rollouts", "6"],  # the demo job: 512 samples a rollout
    "control_plane": ["--rollouts", "4"],
    "rollout_scaling": ["--cpu-engines", "1,2,4", "--fake-engines", "1,8,32", "--duration-s", "3",
                        "--sync-join-repeats", "1"],
    "async_speedup": ["--rounds", "1", "--num-rollout", "6", "--calibration-rounds", "1"],
    "megatron_parity": [],
    "trainer_throughput": ["--rounds", "2"],
    "trainer_memory": ["--sizes", "1024,8192", "--vocab", "37984"],
    "fused_head": ["--rounds", "2"],
    "varlen_attention": ["--rounds", "2"],
    "packed_row_mask": [],
    "trainer_step_profile": ["--steps", "1"],
    "weight_sync_paths": ["--rounds", "2"],
    "trainer_threads": ["--rounds", "2"],
}
# imported or run by the scripts, or not a benchmark (gpu_check is `make gpu-check`, on a CUDA machine)
HELPERS = {"_harness", "_delta_link", "_lora_link", "_precision", "_gateway_host", "run_all", "inprocess_loop",
           "sim_engines", "demo_sweep", "gpu_check", "gpu_families"}
KEYS = ("weight_sync_vs_gloo", "same_host_sync_GBps", "engine_vs_hf_generate", "router_overhead_p50",
        "router_overhead_p99", "gateway_overhead_p50", "gateway_isolation_p99_ratio",
        "buffer_vs_redis", "reward_grpc_vs_inprocess",
        "loop_vs_inprocess", "control_plane_samples_per_s_64", "group_rebuild_s_64", "delta_vs_full_sync",
        "lora_vs_full_sync", "packed_vs_padded_fsdp", "packed_vs_padded_megatron")


def check_listed() -> None:
    """Every script in bench/ runs here: a new one must be added to SCRIPTS (or HELPERS)."""
    missing = {p.stem for p in BENCH.glob("*.py")} - set(SCRIPTS) - HELPERS
    if missing:
        raise SystemExit(f"bench/run_all.py: add {', '.join(sorted(missing))} to SCRIPTS (with its make-bench "
                         "arguments) or to HELPERS")


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {}


def run(name: str, args: list[str]) -> tuple[str, dict, float, int]:
    start = time.monotonic()
    print(f"== bench/{name}.py {' '.join(args)}", flush=True)
    # the repository root on the path: a script may import the test fixtures that start engines
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], capture_output=True, text=True,
                          check=False, env=env)
    elapsed = time.monotonic() - start
    out = proc.stdout if proc.returncode == 0 else f"{proc.stdout}\nFAILED (exit {proc.returncode}):\n" \
                                                   f"{proc.stderr[-3000:]}"
    print(out, flush=True)
    return out, last_json(proc.stdout) if proc.returncode == 0 else {}, elapsed, proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated script names (default: all)")
    parser.add_argument("--out", type=Path, default=BENCH / "RESULTS.md")
    args = parser.parse_args(argv)
    check_listed()
    names = [n for n in args.only.split(",") if n] or list(SCRIPTS)
    unknown = set(names) - set(SCRIPTS)
    if unknown:
        raise SystemExit(f"bench/run_all.py: unknown script(s) {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(SCRIPTS)}")
    started, described = time.monotonic(), machine()
    sections, figures, failed = [], {}, []
    for name in names:
        out, result, elapsed, code = run(name, SCRIPTS[name])
        figures.update(result)
        if code:
            failed.append(name)
        command = " ".join([f"bench/{name}.py", *SCRIPTS[name]])
        sections.append(f"## {command}\n\n({elapsed:.0f} s)\n\n```\n{out.strip()}\n```\n")
    combined = {key: figures.get(key) for key in KEYS}
    line = json.dumps(combined)
    total_s = time.monotonic() - started
    args.out.write_text(
        "# Benchmark results\n\n"
        f"`make bench` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {total_s / 60:.1f} minutes.\n\n"
        f"Machine: {described} (load at the start; at the end {machine().rsplit('load average ', 1)[1]}).\n\n"
        "Every figure is a ratio to its baseline measured side by side in the same run (see each script's "
        "docstring); on a shared machine the other load moves both sides.\n\n"
        + "\n".join(sections) + f"\n## Combined\n\n```\n{line}\n```\n")
    print(f"bench: {len(names)} scripts in {total_s / 60:.1f} min, results in {args.out}"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
