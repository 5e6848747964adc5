"""The agent gateway's overhead: a 4-turn session through the gateway (the real `openai` client, the OpenAI API,
the chat template, the trajectory record) against the same token requests sent straight to the router's /generate.

`python bench/gateway_overhead.py [--sessions 50]`. One CPU engine (a tiny model with a tools chat template) behind
the real sglang-router; the gateway runs in its own process, as in the rollout service. The first session records
the /generate bodies the gateway sends, and it and the next WARMUP_SESSIONS warm both paths up untimed (imports,
template, pooled connections); then each turn of every later session is paired with the same body sent straight to
the router, the two sent back to back in alternating order (so load on a shared machine falls on both alike; greedy
decoding: both generate the same tokens, which is checked). Each request of a pair starts after a SETTLE_S pause,
so that neither runs into what the other left running: without it, one run on a loaded 2-core machine gave a median
ratio of 0.13 over the pairs where the gateway went second and 0.06 where it went first, and the median over all
pairs fell between the two modes. Overhead at p50 = the median over pairs of gateway latency / direct latency - 1
(p99 likewise). The table also gives each side's median, the CPU time per turn of the `openai` client (the bench
process's thread, around each call) and of the gateway process (its two bench calls per session included): on a
loaded machine the added latency grows with them. Prints a table, then one JSON line (`gateway_overhead_p50`, goal
<= 0.10).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, http_ok, median, percentile, print_table, start_engine  # noqa: E402
from examples.agent.model import build_agent_model  # noqa: E402
from services.common import procs  # noqa: E402
from services.rollout.local import start_router  # noqa: E402
from services.rollout.pool.router import RouterClient  # noqa: E402

NUM_TURNS = 4
MAX_TOKENS = 16
WARMUP_SESSIONS = 2  # after the recording one: untimed
SETTLE_S = 0.02  # the pause before each request of a pair
HOST_SCRIPT = Path(__file__).with_name("_gateway_host.py")


def user_turn(turn: int) -> dict[str, str]:
    return {"role": "user", "content": f"Turn {turn}: what is {turn}+{turn}?"}


def session_pairs(client: Any, http: Any, gateway_url: str, router_url: str, bodies: list[dict[str, Any]],
                  expected: list[list[int]], gateway_first: bool) -> list[tuple[float, float, float]]:
    """One 4-turn session through the gateway, each turn paired with its recorded body sent straight to the router:
    (gateway seconds, direct seconds, the openai client's CPU seconds) per turn."""
    client = client.with_options(api_key=http.post(f"{gateway_url}/bench/open").json()["key"])
    messages: list[dict[str, Any]] = []
    pairs = []
    for turn in range(NUM_TURNS):
        messages.append(user_turn(turn))
        timed: dict[str, float] = {}
        for side in (("gateway", "direct") if (turn + gateway_first) % 2 else ("direct", "gateway")):
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            if side == "gateway":
                cpu_start = time.thread_time()
                reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
                timed[side] = time.perf_counter() - start
                timed["client_cpu"] = time.thread_time() - cpu_start
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            else:
                direct = http.post(f"{router_url}/generate", json=bodies[turn])
                timed[side] = time.perf_counter() - start
                direct.raise_for_status()
                if direct.json()["output_ids"] != expected[turn]:
                    raise SystemExit("the replayed requests generated other tokens: not greedy?")
        pairs.append((timed["gateway"], timed["direct"], timed["client_cpu"]))
    if http.get(f"{gateway_url}/bench/bodies").json() != bodies:
        raise SystemExit("the gateway sent other /generate bodies than in the first session")
    return pairs


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    import httpx
    import openai

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=50, help="4-turn sessions, each turn paired with a direct one")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-gateway-"))
    model = build_agent_model(work / "model")
    engine, engine_url = start_engine(work, model, "engine")
    router_port, gateway_port = procs.free_port(), procs.free_port()
    router = start_router(router_port, procs.free_port(), work / "router.log")
    router_url, gateway_url = f"http://{procs.HOST}:{router_port}", f"http://{procs.HOST}:{gateway_port}"
    gateway = procs.ManagedProcess("gateway", [sys.executable, str(HOST_SCRIPT), "--model-path", str(model),
                                               "--router-url", router_url, "--port", str(gateway_port)],
                                   work / "gateway.log").start()
    try:
        with RouterClient(router_url, timeout_s=10.0) as admin:
            admin.add_worker(engine_url, timeout_s=60.0)
        gateway.wait_ready(http_ok(f"{gateway_url}/healthz"), timeout_s=120)
        client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="-", timeout=120.0, max_retries=0)
        with httpx.Client(timeout=120.0) as http, client:
            # the first session records the bodies and warms up both paths
            first = client.with_options(api_key=http.post(f"{gateway_url}/bench/open").json()["key"])
            messages: list[dict[str, Any]] = []
            for turn in range(NUM_TURNS):
                messages.append(user_turn(turn))
                reply = first.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            bodies = http.get(f"{gateway_url}/bench/bodies").json()
            expected = [http.post(f"{router_url}/generate", json=body).json()["output_ids"] for body in bodies]
            for index in range(WARMUP_SESSIONS):
                session_pairs(client, http, gateway_url, router_url, bodies, expected, index % 2 == 0)
            cpu_start_s = cpu_seconds(gateway.pid)
            pairs = [pair for index in range(args.sessions)
                     for pair in session_pairs(client, http, gateway_url, router_url, bodies, expected, index % 2 == 0)]
            gateway_cpu_s = cpu_seconds(gateway.pid) - cpu_start_s
    finally:
        gateway.stop()
        router.stop()
        engine.stop()
    gateway_s, direct_s = [g for g, _, _ in pairs], [d for _, d, _ in pairs]
    ratios = [g / d - 1 for g, d, _ in pairs]
    figures = {50: median(ratios), 99: percentile(ratios, 99)}
    row = [1e3 * median(direct_s), 1e3 * median(gateway_s), 1e3 * median([g - d for g, d, _ in pairs]),
           1e3 * median([c for _, _, c in pairs]), 1e3 * gateway_cpu_s / len(pairs), figures[50], figures[99]]
    prompt_tokens = [len(body["input_ids"]) for body in bodies]
    print_table(f"agent gateway overhead per turn: {len(pairs)} turns ({args.sessions} sessions of {NUM_TURNS}), each "
                f"paired with the same /generate sent direct (prompts of {prompt_tokens} tokens, up to {MAX_TOKENS} "
                "generated)",
                ["direct p50 ms", "gateway p50 ms", "added p50 ms", "openai client CPU ms per turn",
                 "gateway CPU ms per turn",
                 "overhead p50 (goal <= 0.10)", "overhead p99"],
                [row])
    emit({"gateway_overhead_p50": figures[50], "gateway_overhead_p99": figures[99]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
