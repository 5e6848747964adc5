"""`make chaos`: random kills during a fully_async job of at least 10 rollouts on a local stack with authentication on
and the default settings, ten runs in a row.

Kills, at random and each kind at least once: an engine (the manager replaces it), the rollout manager, the buffer,
the reward service, Redis (restarted from its AOF), the trainer with the job API it serves (SIGKILL: its job resumes
from its latest checkpoint) and an eviction of the trainer (SIGTERM: it checkpoints, exits 0, the job resumes); each
is started again on its port a moment later, by this harness the way Kubernetes restarts a pod, never by hand.
Then checks in Redis that every prompt slot was trained at most once and none was lost, and that the job ended.
Ends with one JSON line: {"runs": 10, "kills": K, "lost": 0, "duplicated": 0, "manual_steps": 0,
"jobs_succeeded": 10, "kinds": {...}}. `--quick` runs one shorter job with one kill of each kind (the form
`make test` runs); `--runs N` sets the number of runs.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

from physarum import stack, tasks, tinymodel
from services.common import procs
from services.rollout.client import RolloutClient
from services.trainer.api.client import TERMINAL_STATES, JobsRestClient
from tests.e2e import durability as d
from tests.fuzz.cli import run_from_args
from tests.fuzz.fuzz import operator_credentials

KINDS = ("engine", "rollout", "buffer", "reward", "redis", "trainer", "evict")
BATCH, SAMPLES = 4, 2


def kill_one(work_dir: Path, kind: str, rng: random.Random) -> None:
    """SIGKILL one process of `kind` (evict: SIGTERM to the trainer); it is started again on its port after a short
    outage, as Kubernetes would restart its pod."""
    if kind == "engine":
        with RolloutClient(stack.read_state(work_dir)["rollout_addr"]) as rollout:
            engines = [e for e in rollout.pool_status().engines if e.pid]
        engines = [e for e in engines if procs.start_time(e.pid) is not None]  # not one that just exited
        if engines:
            engine = rng.choice(engines)
            try:
                d.kill_pid(engine.pid, procs.start_time(engine.pid), f"engine {engine.url}")
            except AssertionError:  # it exited between the listing and the kill (a replacement of a killed one)
                print(f"engine {engine.url} exited before the kill", flush=True)
        return
    if kind == "evict":  # SIGTERM, as Kubernetes evicts a pod; the trainer checkpoints and exits by itself
        entry = d.entry_of(work_dir, "trainer")
        os.kill(entry["pid"], signal.SIGTERM)
        d.wait_for("the evicted trainer exits", lambda: not stack._owned(entry), 300.0, interval_s=0.2)
        stack.restart(work_dir, "trainer")
        return
    d.kill(work_dir, kind)
    time.sleep(rng.uniform(0.5, 2.0))
    stack.restart(work_dir, kind)


def job_state(client: JobsRestClient, job_id: str) -> dict:
    """The job, asked again while the trainer's own peers restart under it."""
    return d.wait_for(f"job {job_id} answers", lambda: _get(client, job_id), 300.0, interval_s=0.5)


def _get(client: JobsRestClient, job_id: str) -> dict | None:
    try:
        return client.get(job_id)
    except Exception:  # noqa: BLE001 - the job API restarts with the trainer; its answer may be slow meanwhile
        return None


def run(work_dir: Path, *, num_rollout: int, extra_kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    model_dir = tinymodel.build_tiny_model(work_dir / "model", tasks.corpus())
    prompts = d.write_prompts(work_dir / "prompts.jsonl", [(a, a + 1) for a in range(8)])
    stack_dir = work_dir / "stack"
    state = stack.up(stack.StackOptions(work_dir=stack_dir, model_path=model_dir, num_engines=2, trainer_threads=1,
                                        engine_per_token_delay_s=0.05, auth=True,
                                        plugin_allowlist="tests,examples"))
    schedule = [*rng.sample(KINDS, len(KINDS)), *(rng.choice(KINDS) for _ in range(extra_kills))]
    kinds: dict[str, int] = {}
    job_id = "chaos"
    spec = {"job_id": job_id, "hf_checkpoint": str(model_dir), "prompt_data": str(prompts),
            "num_rollout": num_rollout, "rollout_batch_size": BATCH, "n_samples_per_prompt": SAMPLES,
            "global_batch_size": SAMPLES * BATCH, "rollout_max_response_len": 4, "rm_type": "exact_match",
            "lr": 1e-4, "lease_timeout_s": 5.0, "rollout_timeout_s": 300.0, "mode": "fully_async",
            "save": str(work_dir / "ckpt"), "save_interval": 1}  # a killed trainer resumes from its last rollout
    try:
        with operator_credentials(stack_dir), JobsRestClient(state["trainer_url"], timeout_s=30) as client:
            client.submit(spec)
            for kind in schedule:
                job = job_state(client, job_id)
                if job["state"] in TERMINAL_STATES or job["rollout_id"] >= num_rollout - 1:
                    break  # a kill after the last rollout could only hit a job that has ended
                time.sleep(rng.uniform(0.5, 2.0))
                print(f"kill {kind} at rollout {job['rollout_id']}", flush=True)
                kill_one(stack_dir, kind, rng)
                kinds[kind] = kinds.get(kind, 0) + 1
            final = d.wait_for(f"job {job_id} ends", lambda: (j := _get(client, job_id)) and
                               j["state"] in TERMINAL_STATES and j, 900.0, interval_s=1.0)
            book = d.ledger(stack.read_state(stack_dir)["redis_url"], job_id, num_rollout, BATCH)
    finally:
        stack.down(stack_dir)
    duplicated = sum(1 for where in book.places.values() if len(where) > 1)
    lost = sum(1 for slot in book.slots_before_cursor() if slot not in book.places) + sum(
        1 for where in book.places.values() if where[0].startswith("assigned to rollout"))
    if final["error"]:
        print(f"job error: {final['error']}", flush=True)
    return {"kills": sum(kinds.values()), "lost": lost, "duplicated": duplicated, "job": final["state"],
            "kinds": kinds, "manual_steps": 0}  # every restart above is the harness's, none a person's


def runs(work_dir: Path, *, num_runs: int, quick: bool, seed: int) -> dict:
    """`num_runs` runs in a row (seeds seed, seed + 1, ...), each on a stack of its own; their totals."""
    total = {"runs": 0, "kills": 0, "lost": 0, "duplicated": 0, "manual_steps": 0, "jobs_succeeded": 0, "kinds": {}}
    for i in range(num_runs):
        one = run(work_dir / f"run-{i}", num_rollout=10 if quick else 16, extra_kills=0 if quick else 6,
                  seed=seed + i)
        print(f"run {i}: {one}", flush=True)
        total["runs"] += 1
        total["jobs_succeeded"] += one["job"] == "SUCCEEDED"
        for key in ("kills", "lost", "duplicated", "manual_steps"):
            total[key] += one[key]
        for kind, count in one["kinds"].items():
            total["kinds"][kind] = total["kinds"].get(kind, 0) + count
    return total


def main(argv: list[str] | None = None) -> int:
    summary = run_from_args(
        argv, prog="tests.fuzz.chaos", description=__doc__.splitlines()[0],
        quick_help="shorter jobs, one kill of each kind (one run unless --runs says otherwise)",
        add_arguments=lambda parser: parser.add_argument("--runs", type=int, default=None,
                                                         help="runs in a row (default: 10, 1 with --quick)"),
        run=lambda work, args: runs(work, num_runs=args.runs or (1 if args.quick else 10), quick=args.quick,
                                    seed=args.seed))
    every_kind = set(summary["kinds"]) == set(KINDS)
    ok = summary["lost"] == 0 and summary["duplicated"] == 0 and summary["jobs_succeeded"] == summary["runs"] \
        and every_kind
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
