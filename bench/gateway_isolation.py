"""Head-of-line blocking in the agent gateway: normal sessions' latency while other sessions send maximum-size
hostile messages, against the same sessions without them.

`python bench/gateway_isolation.py [--rounds 4] [--requests 12]`. One CPU engine (the agent example's tiny model,
2,048-token context) behind the real sglang-router; the gateway in its own process (tests/fuzz/gateway_host.py), as
the rollout service runs it. NORMAL_WORKERS threads each send short chat completions (a fresh one-turn conversation,
MAX_TOKENS new tokens) one after another. The run alternates quiet phases and hostile phases, --rounds of each, every
phase --requests requests per normal worker; in a hostile phase HOSTILE_WORKERS processes (started once, before the
first phase, and switched on and off: their start-up is not timed) each send a body just under the gateway's 4 MiB
bound every --hostile-interval-s (0.5 s: 2 x 8 MB/s), whose one user message is ~4 million characters (OpenAI and
Anthropic alternately, encoded once), which the gateway must refuse with a 400 (past the model's context) without
stalling the others. Sent back to back instead, the hostile bodies keep the gateway's
one interpreter busy parsing (a few tens of ms of CPU each): that is load, not blocking, and it moves the ratio with
the machine's spare cores. Alternating the phases spreads the shared machine's other load over both sides.
gateway_isolation_p99_ratio = normal requests' p99 latency in hostile phases / in quiet phases (goal <= 1.5).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, http_ok, median, percentile, print_table, start_engine  # noqa: E402
from examples.agent.model import build_agent_model  # noqa: E402
from services.common import procs  # noqa: E402
from services.rollout.local import start_router  # noqa: E402
from services.rollout.pool.router import RouterClient  # noqa: E402

NORMAL_WORKERS = 4
HOSTILE_WORKERS = 2
MAX_TOKENS = 8
BODY_BYTES = (4 << 20) - 4096  # just under the gateway's default bound


def hostile_bodies() -> list[tuple[str, bytes]]:
    """(route, body): one maximum-size user message in each API, encoded once."""
    text = "12+34=46 " * ((BODY_BYTES - 1024) // 9)
    openai = {"model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": text}]}
    return [("/v1/chat/completions", json.dumps(openai).encode()),
            ("/v1/messages", json.dumps({**openai, "stream": True}).encode())]


def normal_worker(http, url: str, keys: list[str], requests: int, latencies: list[float], errors: list[str]) -> None:
    for i in range(requests):
        key = keys[i % len(keys)]
        start = time.perf_counter()
        reply = http.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json={
            "model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": f"What is {i}+{i}?"}]})
        latencies.append(time.perf_counter() - start)
        if reply.status_code != 200:
            errors.append(f"normal: {reply.status_code} {reply.text[:200]}")


def hostile_sender(url: str, key: str, interval_s: float, active: Any, stop: Any, results: Any) -> None:
    """A process of its own, started once before the first phase (so that neither its start nor its sending takes
    anything from the timed threads' interpreter): while `active` is set, a hostile body every `interval_s` (or
    back to back, if one takes longer); once `stop` is set, (status counts, latencies) on `results`."""
    import httpx

    bodies = hostile_bodies()
    headers = {"authorization": f"Bearer {key}", "x-api-key": key, "content-type": "application/json"}
    counts: dict[int, int] = {}
    latencies: list[float] = []
    with httpx.Client(timeout=120.0) as http:
        while not stop.is_set():
            if not active.wait(0.1):
                continue
            route, body = bodies[len(latencies) % len(bodies)]
            start = time.perf_counter()
            status = http.post(f"{url}{route}", headers=headers, content=body).status_code
            latencies.append(time.perf_counter() - start)
            counts[status] = counts.get(status, 0) + 1
            stop.wait(max(0.0, interval_s - latencies[-1]))
    results.put((counts, latencies))


class HostileSenders:
    """HOSTILE_WORKERS sender processes, one session each, switched on for the hostile phases."""

    def __init__(self, url: str, keys: list[str], interval_s: float) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.active, self.stop, self.results = spawn.Event(), spawn.Event(), spawn.Queue()
        self.processes = [spawn.Process(target=hostile_sender, args=(url, key, interval_s, self.active, self.stop,
                                                                     self.results)) for key in keys]
        for process in self.processes:
            process.start()

    def close(self) -> tuple[dict[int, int], list[float]]:
        """Stop them; every answer's status counted, and their latencies."""
        self.active.clear()
        self.stop.set()
        counts: dict[int, int] = {}
        latencies: list[float] = []
        for _ in self.processes:
            sent, sent_latencies = self.results.get(timeout=300)
            for status, count in sent.items():
                counts[status] = counts.get(status, 0) + count
            latencies += sent_latencies
        for process in self.processes:
            process.join(timeout=60)
        return counts, latencies


def phase(url: str, keys: list[str], requests: int, senders: HostileSenders | None, errors: list[str]) -> list[float]:
    """One phase: every normal worker's latencies (with the hostile senders on, if given)."""
    import httpx

    latencies: list[float] = []
    with httpx.Client(timeout=120.0) as http:
        if senders is not None:
            senders.active.set()
            time.sleep(0.5)  # the hostile load is on before the first timed request
        workers = [threading.Thread(target=normal_worker, args=(http, url, keys[w::NORMAL_WORKERS], requests,
                                                                latencies, errors))
                   for w in range(NORMAL_WORKERS)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if senders is not None:
            senders.active.clear()
    return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4, help="quiet and hostile phases, alternating, of each")
    parser.add_argument("--requests", type=int, default=12, help="requests per normal worker per phase")
    parser.add_argument("--workers", type=int, default=4, help="the gateway's worker pool")
    parser.add_argument("--hostile-interval-s", type=float, default=0.5,
                        help="each hostile sender's pace: one maximum-size body per this many seconds")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-isolation-"))
    model = build_agent_model(work / "model")
    engine, engine_url = start_engine(work, model, "engine")
    router_port, gateway_port = procs.free_port(), procs.free_port()
    router = start_router(router_port, procs.free_port(), work / "router.log")
    router_url, gateway_url = f"http://{procs.HOST}:{router_port}", f"http://{procs.HOST}:{gateway_port}"
    turns = 2 * args.rounds * args.requests + 1  # per normal worker; a session holds 64 turns
    num_normal = NORMAL_WORKERS * (turns // 60 + 1)
    keys_file = work / "keys"
    gateway = procs.ManagedProcess("gateway", procs.python_module(
        "tests.fuzz.gateway_host", "--model-path", str(model), "--router-url", router_url, "--port", str(gateway_port),
        "--sessions", str(num_normal + HOSTILE_WORKERS), "--workers", str(args.workers), "--keys-file",
        str(keys_file)), work / "gateway.log").start()
    quiet: list[float] = []
    loud: list[float] = []
    counts: dict[int, int] = {}
    hostile_latencies: list[float] = []
    errors: list[str] = []
    hostile_s = 0.0
    try:
        with RouterClient(router_url, timeout_s=10.0) as admin:
            admin.add_worker(engine_url, timeout_s=60.0)
        gateway.wait_ready(lambda: keys_file.exists() and http_ok(f"{gateway_url}/healthz")(), timeout_s=120)
        keys = keys_file.read_text().split()
        normal_keys, hostile_keys = keys[:num_normal], keys[num_normal:]
        phase(gateway_url, normal_keys, 2, None, errors)  # warm-up
        senders = HostileSenders(gateway_url, hostile_keys, args.hostile_interval_s)
        try:
            time.sleep(5.0)  # the senders have started (their interpreters, their bodies) before the first phase
            for _ in range(args.rounds):
                quiet += phase(gateway_url, normal_keys, args.requests, None, errors)
                hostile_start = time.monotonic()
                loud += phase(gateway_url, normal_keys, args.requests, senders, errors)
                hostile_s += time.monotonic() - hostile_start
        finally:
            counts, hostile_latencies = senders.close()
        alive = gateway.alive()
    finally:
        gateway.stop()
        router.stop()
        engine.stop()
    if errors or not alive or set(counts) != {400}:
        raise SystemExit(f"gateway alive {alive}; hostile answers {counts}; errors {errors[:5]}")
    ratio = percentile(loud, 99) / percentile(quiet, 99)
    print_table("Normal sessions' latency (s), quiet vs beside maximum-size hostile messages",
                ["phase", "requests", "p50", "p99", "hostile requests (all 400)", "hostile MB/s", "hostile p50"],
                [["quiet", len(quiet), median(quiet), percentile(quiet, 99), 0, 0, "-"],
                 ["hostile", len(loud), median(loud), percentile(loud, 99), counts[400],
                  counts[400] * BODY_BYTES / hostile_s / 1e6, median(hostile_latencies)]])
    print(f"gateway_isolation_p99_ratio = {ratio:.3f} (goal <= 1.5)")
    emit({"gateway_isolation_p99_ratio": round(ratio, 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
