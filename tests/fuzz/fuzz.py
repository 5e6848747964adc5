"""`make fuzz`: hostile and malformed inputs against a local stack with authentication on.

Starts the stack (per-service tokens, plugins allowed under `tests` and `examples`) and the agent gateway in its own
process over the stack's router (gateway_host), sends every input class of `inputs` and the gateway's hostile
requests of its three APIs (`gateway_inputs`), checks that every service and the gateway still answer (each gateway
session its state, the untouched ones a completion), runs a normal job, prints a table per input class and ends with
one JSON line: {"inputs": N, "clear_errors": N, "accepted_unauthenticated": N, "internal_errors": N, "hangs": N,
"crashes": N, "normal_job_after": true, "gateway": {"inputs": N, "internal_errors": N, "hangs": N, "crashed": 0,
"sessions": N, "sessions_answering": N}}. `--quick` sends a sample of each class (the form `make test` runs).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx

from physarum import stack, tasks, tinymodel
from services.common import auth, procs
from services.common.grpc_client import wait_for_health
from services.rollout.client import RolloutClient
from services.trainer.api.client import TERMINAL_STATES, JobsRestClient
from testkit.engines import start_engines
from tests.fuzz import gateway_inputs, inputs, probes
from tests.fuzz.cli import run_from_args

GATEWAY_SESSIONS = 8  # the hostile requests go round these
CONTROL_SESSIONS = 2  # and never to these: each must still complete a turn afterwards
GATEWAY_REQUESTS = {True: 60, False: 1200}  # quick, full
GRPC_SERVICES = {"buffer": "buffer_addr", "reward": "reward_addr", "rollout": "rollout_addr", "trainer": "trainer_addr"}


def start(work_dir: Path, num_engines: int) -> tuple[dict, Path, Path]:
    """The stack with authentication on; returns its state, the tiny model and the training data."""
    model_dir = tinymodel.build_tiny_model(work_dir / "model", tasks.corpus())
    train_path, _ = tasks.write_addition_task(work_dir / "task", num_test=20, max_operand=9)
    state = stack.up(stack.StackOptions(work_dir=work_dir / "stack", model_path=model_dir, num_engines=num_engines,
                                        trainer_threads=1, auth=True, plugin_allowlist="tests,examples"))
    return state, model_dir, train_path


@contextlib.contextmanager
def operator_credentials(stack_dir: Path) -> Iterator[None]:
    """This process calls the stack as its operator (the tokens `up` issued it) until the block ends."""
    before = os.environ.get(auth.TOKEN_DIR_ENV)
    os.environ[auth.TOKEN_DIR_ENV] = str(stack.operator_token_dir(stack_dir))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(auth.TOKEN_DIR_ENV, None)
        else:
            os.environ[auth.TOKEN_DIR_ENV] = before


def target_of(state: dict, work_dir: Path, http: httpx.Client, foreign_engine_url: str) -> inputs.Target:
    tokens = {s: auth.read_token(s) for s in ("buffer", "reward", "rollout", "trainer")}
    with RolloutClient(state["rollout_addr"]) as rollout:
        engine_urls = [e.url for e in rollout.pool_status().engines]
    channels = {s: grpc.insecure_channel(state[key], options=[("grpc.max_send_message_length", 64 << 20)])
                for s, key in GRPC_SERVICES.items()}
    rollout_url = state.get("rollout_url") or _rollout_rest(state)
    return inputs.Target(addr={s: state[k] for s, k in GRPC_SERVICES.items()},
                         urls={"reward": state["reward_url"], "rollout": rollout_url, "trainer": state["trainer_url"]},
                         engine_urls=engine_urls, tokens=tokens, router_url=state["router_url"],
                         foreign_engine_url=foreign_engine_url, work_dir=work_dir, channels=channels, http=http)


def _rollout_rest(state: dict) -> str:
    with RolloutClient(state["rollout_addr"]) as rollout:
        return rollout.pool_status().rest_url


def all_inputs(t: inputs.Target, model_dir: Path, train_path: Path, rng: random.Random, quick: bool):
    per_method = 2 if quick else 40
    classes = [inputs.foreign_worker(t),
               inputs.unauthenticated_grpc(t, rng), inputs.random_grpc(t, rng, per_method), inputs.hostile_fields(t),
               inputs.unauthenticated_rest(t), inputs.engine_bodies(t, rng), inputs.job_specs(t, model_dir, train_path),
               inputs.dataset_rows(t), inputs.reward_functions(t)]
    for generated in classes:
        items = list(generated)
        yield from (rng.sample(items, min(len(items), 12)) if quick else items)


@contextlib.contextmanager
def gateway_host(work_dir: Path, model_dir: Path, router_url: str) -> Iterator[tuple[procs.ManagedProcess, str,
                                                                                     list[str]]]:
    """The gateway in its own process over `router_url`: (its process, its URL, its session keys)."""
    port, keys_file = procs.free_port(), work_dir / "gateway-keys"
    host = procs.ManagedProcess("gateway", procs.python_module(
        "tests.fuzz.gateway_host", "--model-path", str(model_dir), "--router-url", router_url, "--port", str(port),
        "--sessions", str(GATEWAY_SESSIONS + CONTROL_SESSIONS), "--keys-file", str(keys_file)),
        work_dir / "gateway.log").start()
    try:
        host.wait_ready(keys_file.exists, timeout_s=120)
        yield host, f"http://{procs.HOST}:{port}", keys_file.read_text().split()
    finally:
        host.stop()


def gateway_answers(http: httpx.Client, url: str, keys: list[str]) -> int:
    """How many sessions still answer: each its state; the control sessions (the last ones) a completion too."""
    answering = 0
    for i, key in enumerate(keys):
        headers = {"authorization": f"Bearer {key}"}
        try:
            ok = http.get(f"{url}/v1/session", headers=headers, timeout=60).status_code == 200
            if ok and i >= GATEWAY_SESSIONS:
                reply = http.post(f"{url}/v1/chat/completions", headers=headers, timeout=120, json={
                    "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "1+1="}]})
                ok = reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
        except httpx.HTTPError:
            ok = False
        answering += ok
    return answering


def healthy(state: dict, engine_urls: list[str]) -> list[str]:
    """The services that do not answer their health check (each within 30 s)."""
    down = []
    for service, key in GRPC_SERVICES.items():
        try:
            wait_for_health(state[key], timeout_s=30.0)
        except TimeoutError:
            down.append(service)
    for url in engine_urls:
        try:
            if httpx.get(f"{url}/health", timeout=30.0).status_code != 200:
                down.append(url)
        except httpx.HTTPError:
            down.append(url)
    return down


def normal_job(state: dict, model_dir: Path, train_path: Path) -> bool:
    spec = {"job_id": "fuzz-normal", "hf_checkpoint": str(model_dir), "prompt_data": str(train_path),
            "num_rollout": 2, "rollout_batch_size": 2, "n_samples_per_prompt": 2, "global_batch_size": 4,
            "rollout_max_response_len": 4, "rm_type": "exact_match", "lr": 1e-4, "rollout_timeout_s": 300.0}
    with JobsRestClient(state["trainer_url"], timeout_s=30, token=auth.read_token("trainer")) as client:
        job_id = client.submit(spec)["job_id"]
        deadline = time.monotonic() + 480
        while (job := client.get(job_id))["state"] not in TERMINAL_STATES and time.monotonic() < deadline:
            time.sleep(1.0)
    print(f"normal job {job_id}: {job['state']} {job.get('error', '')}", flush=True)
    return job["state"] == "SUCCEEDED"


def run(work_dir: Path, *, quick: bool, seed: int = 0) -> dict:
    rng = random.Random(seed)
    state, model_dir, train_path = start(work_dir, num_engines=1)
    tally = probes.Tally()
    [(foreign, foreign_url)] = start_engines(model_dir, work_dir / "foreign", 1, "--fake-compute", "true")
    try:
        with operator_credentials(work_dir / "stack"), httpx.Client() as http, gateway_host(
                work_dir, model_dir, state["router_url"]) as (gateway, gateway_url, keys):
            t = target_of(state, work_dir, http, foreign_url)
            hostile = itertools.chain(all_inputs(t, model_dir, train_path, rng, quick), gateway_inputs.gateway_requests(
                gateway_url, keys[:GATEWAY_SESSIONS], http, rng, GATEWAY_REQUESTS[quick]))
            with ThreadPoolExecutor(4) as pool:  # a few at once: hostile inputs must not starve each other
                results = pool.map(lambda item: (item[0], item[1], item[2]()), hostile)
                for input_class, what, outcome in results:
                    tally.add(input_class, outcome, what)
            down = healthy(state, t.engine_urls)
            answering = gateway_answers(http, gateway_url, keys)
            crashed = 0 if gateway.alive() else 1
            job_ok = normal_job(state, model_dir, train_path) if not down else False
    finally:
        foreign.stop()
        stack.down(work_dir / "stack")
    report(tally)
    gateway_counts = tally.counts.get("gateway", {})
    internal = gateway_counts.get(probes.INTERNAL, 0)
    return {"inputs": tally.total(), "clear_errors": tally.total(probes.CLEAR),
            "accepted_unauthenticated": tally.total(probes.UNAUTH), "internal_errors": tally.total(probes.INTERNAL),
            "hangs": tally.total(probes.HANG), "crashes": len(down) + crashed, "normal_job_after": job_ok,
            "gateway": {"inputs": sum(gateway_counts.values()), "internal_errors": internal,
                        "hangs": gateway_counts.get(probes.HANG, 0), "crashed": crashed, "sessions": len(keys),
                        "sessions_answering": answering}}


def report(tally: probes.Tally) -> None:
    print(f"{'input class':<24}" + "".join(f"{o:>26}" for o in probes.OUTCOMES))
    for input_class, counts in tally.counts.items():
        print(f"{input_class:<24}" + "".join(f"{counts[o]:>26}" for o in probes.OUTCOMES))
    for example in tally.examples:
        print("  " + example)


def main(argv: list[str] | None = None) -> int:
    summary = run_from_args(argv, prog="tests.fuzz.fuzz", description=__doc__.splitlines()[0],
                            quick_help="a sample of each input class",
                            run=lambda work, args: run(work, quick=args.quick, seed=args.seed))
    bad = summary["accepted_unauthenticated"] + summary["internal_errors"] + summary["hangs"] + summary["crashes"]
    gateway = summary["gateway"]
    whole = gateway["sessions_answering"] == gateway["sessions"] and gateway["inputs"] >= GATEWAY_REQUESTS[False]
    return 0 if not bad and summary["normal_job_after"] and (whole or "--quick" in (argv or sys.argv)) else 1


if __name__ == "__main__":
    sys.exit(main())
