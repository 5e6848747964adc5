"""`make chaos`: random kills during fully_async jobs under the default settings, ten runs (jobs) in a row on one
local stack with authentication on.

Kinds of fault: an engine killed (the manager replaces it), the rollout manager, the buffer, the reward service, Redis
(restarted from its AOF), the trainer with the job API it serves (SIGKILL: its job resumes from its latest checkpoint)
and an eviction of the trainer (SIGTERM: it checkpoints, exits 0, the job resumes), each started again on its port by
the stack's supervisor, as Kubernetes restarts a pod, never by this harness or by hand; and `physarum up` run again
mid-job right after a service was killed (it must adopt the running stack: same tokens, same Redis). Each run has
every kind once, at random points of its job (`--kills-per-run N`: N kinds a run, rotating from run to run, for a
busier machine: a restart costs 5-45 s on 2 busy cores). Then checks in Redis that every prompt slot was trained at
most once and none was lost, and that the job ended. Ends with one JSON line: {"runs": 10, "kills": K, "lost": 0,
"duplicated": 0, "manual_steps": 0, "jobs_succeeded": 10, "kinds": {...}}. `--quick` runs one job with one kill of
each kind (the form `make test` runs); `--runs N` sets the number of runs.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from physarum import stack, tasks, tinymodel
from services.common import procs
from services.rollout.client import RolloutClient
from services.trainer.api.client import TERMINAL_STATES, JobsRestClient
from tests.e2e import durability as d
from tests.fuzz.cli import run_from_args
from tests.fuzz.fuzz import operator_credentials

KINDS = ("engine", "rollout", "buffer", "reward", "redis", "trainer", "evict", "up_again")
SUPERVISED_S = 300.0  # how long the supervisor may take to bring a killed service back (a busy 2-core machine)
BATCH, SAMPLES = 4, 2
NUM_ROLLOUT = 8  # four epochs of the 8-prompt dataset
KILLS_PER_RUN = len(KINDS)  # every kind in every run: ten runs in 16 min on 2 busy cores (fewer: a busier machine)


def back(work_dir: Path, name: str, old: dict) -> None:
    """Wait until the supervisor has started `name` again (a new process, recorded, running)."""
    d.wait_for(f"the supervisor starts {name} again", lambda: (e := d.entry_of(work_dir, name))["pid"] != old["pid"]
               and stack.owned(e), SUPERVISED_S, interval_s=0.2)


def kill_one(work_dir: Path, kind: str, rng: random.Random, options: stack.StackOptions) -> None:
    """SIGKILL one process of `kind` (evict: SIGTERM to the trainer; up_again: SIGKILL a service, then `up` at once);
    the supervisor starts it again on its port, as Kubernetes would restart its pod."""
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
        back(work_dir, "trainer", entry)
        return
    if kind == "up_again":  # an operator runs `physarum up` again while a service is down and the job runs
        before = stack.read_state(work_dir)
        victim = rng.choice(("buffer", "reward", "rollout"))
        entry = d.kill(work_dir, victim)
        after = stack.up(options)
        assert (after["redis_url"], after["trainer_url"]) == (before["redis_url"], before["trainer_url"]), after
        assert {e["name"]: e["env"] for e in after["processes"]} == {e["name"]: e["env"] for e in before["processes"]}
        back(work_dir, victim, entry)
        return
    back(work_dir, kind, d.kill(work_dir, kind))


def reached(client: JobsRestClient, job_id: str, rollout_id: int) -> dict:
    """The job once it has reported `rollout_id` (-1: at once) or ended."""
    return d.wait_for(f"job {job_id} at rollout {rollout_id}", lambda: (j := _get(client, job_id)) and (
        j["rollout_id"] >= rollout_id or j["state"] in TERMINAL_STATES) and j, 900.0, interval_s=0.1)


def _get(client: JobsRestClient, job_id: str) -> dict | None:
    try:
        return client.get(job_id)
    except Exception:  # noqa: BLE001 - the job API restarts with the trainer; its answer may be slow meanwhile
        return None


def stack_options(stack_dir: Path, model_dir: Path) -> stack.StackOptions:
    return stack.StackOptions(work_dir=stack_dir, model_path=model_dir, num_engines=2, trainer_threads=1,
                              engine_per_token_delay_s=0.05, auth=True, plugin_allowlist="tests,examples",
                              supervise=True)


@contextlib.contextmanager
def local_stack(work_dir: Path, model_dir: Path) -> Iterator[tuple[Path, JobsRestClient]]:
    """A supervised local stack with authentication on, and an operator's job API client; stopped at the end."""
    stack_dir, start = work_dir / "stack", time.monotonic()
    state = stack.up(stack_options(stack_dir, model_dir))
    print(f"stack up in {time.monotonic() - start:.1f} s", flush=True)
    try:
        with operator_credentials(stack_dir), JobsRestClient(state["trainer_url"], timeout_s=30) as client:
            yield stack_dir, client
    finally:
        stack.down(stack_dir)


def job(stack_dir: Path, client: JobsRestClient, work_dir: Path, model_dir: Path, *, job_id: str, num_rollout: int,
        seed: int, kinds_to_kill: tuple[str, ...] = KINDS, extra_kills: int = 0) -> dict:
    """One job with a kill of each of `kinds_to_kill` in random order and `extra_kills` of random kinds, each once
    the job has reported a random rollout (before the last two); its ledger."""
    rng, t0 = random.Random(seed), time.monotonic()
    prompts = d.write_prompts(work_dir / "prompts.jsonl", [(a, a + 1) for a in range(8)])
    schedule = [*rng.sample(kinds_to_kill, len(kinds_to_kill)), *(rng.choice(KINDS) for _ in range(extra_kills))]
    # kill once the job reported this rollout: at most the third from last, so that two rollouts remain to be killed in
    points = sorted(rng.randint(-1, num_rollout - 3) for _ in schedule)
    kinds: dict[str, int] = {}
    spec = {"job_id": job_id, "hf_checkpoint": str(model_dir), "prompt_data": str(prompts),
            "num_rollout": num_rollout, "rollout_batch_size": BATCH, "n_samples_per_prompt": SAMPLES,
            "global_batch_size": SAMPLES * BATCH, "rollout_max_response_len": 4, "rm_type": "exact_match",
            "lr": 1e-4, "lease_timeout_s": 5.0, "rollout_timeout_s": 300.0, "mode": "fully_async",
            "save": str(work_dir / "ckpt"), "save_interval": 1}  # a killed trainer resumes from its last rollout
    d.wait_for("the job API answers", lambda: _submit(client, spec), 300.0, interval_s=0.2)
    for kind, after in zip(schedule, points, strict=True):
        state = reached(client, job_id, after)
        if state["state"] in TERMINAL_STATES or state["rollout_id"] >= num_rollout - 1:
            break  # a kill after the last rollout could only hit a job that has ended
        time.sleep(rng.uniform(0.0, 0.3))
        print(f"{time.monotonic() - t0:6.1f} s: kill {kind} at rollout {state['rollout_id']}", flush=True)
        kill_one(stack_dir, kind, rng, stack_options(stack_dir, model_dir))
        print(f"{time.monotonic() - t0:6.1f} s: {kind} back", flush=True)
        kinds[kind] = kinds.get(kind, 0) + 1
    final = d.wait_for(f"job {job_id} ends", lambda: (j := _get(client, job_id)) and
                       j["state"] in TERMINAL_STATES and j, 900.0, interval_s=0.2)
    print(f"{time.monotonic() - t0:6.1f} s: job {job_id} {final['state']}", flush=True)
    book = d.ledger(stack.read_state(stack_dir)["redis_url"], job_id, num_rollout, BATCH)
    duplicated = sum(1 for where in book.places.values() if len(where) > 1)
    lost = sum(1 for slot in book.slots_before_cursor() if slot not in book.places) + sum(
        1 for where in book.places.values() if where[0].startswith("assigned to rollout"))
    if final["error"]:
        print(f"job error: {final['error']}", flush=True)
    return {"kills": sum(kinds.values()), "lost": lost, "duplicated": duplicated, "job": final["state"],
            "kinds": kinds, "manual_steps": 0}  # every restart above is the supervisor's, none a person's


def _submit(client: JobsRestClient, spec: dict) -> bool:
    """Submit `spec` unless the job API already has it (a submission whose answer a restart cut off)."""
    if _get(client, spec["job_id"]) is not None:
        return True
    try:
        client.submit(spec)
        return True
    except Exception:  # noqa: BLE001 - the job API may be restarting after the run before
        return False


def run(work_dir: Path, *, num_rollout: int, seed: int, kinds_to_kill: tuple[str, ...] = KINDS,
        extra_kills: int = 0) -> dict:
    """One job on a stack of its own (the short form `make test` runs)."""
    model_dir = tinymodel.build_tiny_model(work_dir / "model", tasks.corpus())
    with local_stack(work_dir, model_dir) as (stack_dir, client):
        return job(stack_dir, client, work_dir, model_dir, job_id="chaos", num_rollout=num_rollout, seed=seed,
                   kinds_to_kill=kinds_to_kill, extra_kills=extra_kills)


def rotation(num_runs: int, per_run: int, rng: random.Random) -> list[tuple[str, ...]]:
    """The kinds each run kills: consecutive slices of one shuffled cycle of KINDS, so every kind comes once before
    any comes again."""
    order = rng.sample(KINDS, len(KINDS))
    return [tuple(order[(i * per_run + k) % len(KINDS)] for k in range(per_run)) for i in range(num_runs)]


def runs(work_dir: Path, *, num_runs: int, quick: bool, seed: int, kills_per_run: int = KILLS_PER_RUN) -> dict:
    """`num_runs` jobs one after another on one stack (seeds seed, seed + 1, ...): the kills of a run hit a stack
    that earlier runs' kills and restarts left behind, as a long-lived cluster's would; their totals."""
    total = {"runs": 0, "kills": 0, "lost": 0, "duplicated": 0, "manual_steps": 0, "jobs_succeeded": 0, "kinds": {}}
    model_dir = tinymodel.build_tiny_model(work_dir / "model", tasks.corpus())
    per_run = len(KINDS) if quick else max(1, min(kills_per_run, len(KINDS)))
    with local_stack(work_dir, model_dir) as (stack_dir, client):
        for i, kinds in enumerate(rotation(num_runs, per_run, random.Random(seed))):
            start = time.monotonic()
            one = job(stack_dir, client, work_dir / f"run-{i}", model_dir, job_id=f"chaos-{i}",
                      num_rollout=NUM_ROLLOUT, seed=seed + i, kinds_to_kill=kinds)
            print(f"run {i} ({time.monotonic() - start:.0f} s): {one}", flush=True)
            total["runs"] += 1
            total["jobs_succeeded"] += one["job"] == "SUCCEEDED"
            for key in ("kills", "lost", "duplicated", "manual_steps"):
                total[key] += one[key]
            for kind, count in one["kinds"].items():
                total["kinds"][kind] = total["kinds"].get(kind, 0) + count
    return total


def add_arguments(parser) -> None:
    parser.add_argument("--runs", type=int, default=None, help="runs in a row (default: 10, 1 with --quick)")
    parser.add_argument("--kills-per-run", type=int, default=KILLS_PER_RUN,
                        help=f"kinds killed in each run, rotating (default: all {len(KINDS)})")


def main(argv: list[str] | None = None) -> int:
    summary = run_from_args(
        argv, prog="tests.fuzz.chaos", description=__doc__.splitlines()[0],
        quick_help="shorter jobs, one kill of each kind (one run unless --runs says otherwise)",
        add_arguments=add_arguments,
        run=lambda work, args: runs(work, num_runs=args.runs or (1 if args.quick else 10), quick=args.quick,
                                    seed=args.seed, kills_per_run=args.kills_per_run))
    every_kind = set(summary["kinds"]) == set(KINDS)
    ok = summary["lost"] == 0 and summary["duplicated"] == 0 and summary["jobs_succeeded"] == summary["runs"] \
        and every_kind
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
