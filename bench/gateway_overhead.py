"""The agent gateway's overhead: a 4-turn session through the gateway (the OpenAI API, the chat template, the
trajectory record) against the same token requests sent straight to the router's /generate.

`python bench/gateway_overhead.py [--sessions 50]`. One CPU engine (a tiny model with a tools chat template) behind
the real sglang-router; the gateway runs in its own process, as in the rollout service. The first session, through
the real `openai` client, records the /generate bodies the gateway sends, and it and the next WARMUP_SESSIONS (also
through the `openai` client, whose CPU per call they measure) warm both paths up untimed. Then each turn of every
later session is paired with the same body sent straight to the router, the two sent back to back in alternating
order (so load on a shared machine falls on both alike; greedy decoding: both generate the same tokens, which is
checked). In the timed pairs both sides go through one pooled httpx client, the gateway side with the very JSON the
`openai` client sends: the ratio is then the gateway's own cost, not the client library's (3-4 ms of CPU a call,
about a tenth of a 16-token turn here, which an agent pays for its messages whichever server answers; the table
shows it beside the result). Each request of a pair starts after a SETTLE_S pause, so that neither runs into what
the other left running: without it, one run on a loaded 2-core machine gave a median ratio of 0.13 over the pairs
where the gateway went second and 0.06 where it went first. Overhead at p50 = the median over pairs of gateway
latency / direct latency - 1 (p99 likewise). The table also gives each side's median and the gateway process's CPU
time per turn (its two bench calls per session included). Prints a table, then one JSON line
(`gateway_overhead_p50`, goal <= 0.10).
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


def openai_session(client: Any, http: Any, gateway_url: str) -> float:
    """One untimed 4-turn session through the real `openai` client: its CPU seconds per call."""
    client = client.with_options(api_key=http.post(f"{gateway_url}/bench/open").json()["key"])
    messages: list[dict[str, Any]] = []
    cpu_s = 0.0
    for turn in range(NUM_TURNS):
        messages.append(user_turn(turn))
        start = time.thread_time()
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
        cpu_s += time.thread_time() - start
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return cpu_s / NUM_TURNS


def session_pairs(http: Any, gateway_url: str, router_url: str, bodies: list[dict[str, Any]],
                  expected: list[list[int]], gateway_first: bool) -> list[tuple[float, float]]:
    """One 4-turn session through the gateway, each turn paired with its recorded body sent straight to the router:
    (gateway seconds, direct seconds) per turn."""
    auth = {"Authorization": f"Bearer {http.post(f'{gateway_url}/bench/open').json()['key']}"}
    messages: list[dict[str, Any]] = []
    pairs = []
    for turn in range(NUM_TURNS):
        messages.append(user_turn(turn))
        timed: dict[str, float] = {}
        for side in (("gateway", "direct") if (turn + gateway_first) % 2 else ("direct", "gateway")):
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            if side == "gateway":
                reply = http.post(f"{gateway_url}/v1/chat/completions", headers=auth,
                                  json={"model": "policy", "messages": messages, "max_tokens": MAX_TOKENS})
                timed[side] = time.perf_counter() - start
                reply.raise_for_status()
                content = reply.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": content or ""})
            else:
                direct = http.post(f"{router_url}/generate", json=bodies[turn])
                timed[side] = time.perf_counter() - start
                direct.raise_for_status()
                if direct.json()["output_ids"] != expected[turn]:
                    raise SystemExit("the replayed requests generated other tokens: not greedy?")
        pairs.append((timed["gateway"], timed["direct"]))
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
            # the first session records the bodies; the warm-ups (openai client too) warm both paths up
            client_cpu_s = [openai_session(client, http, gateway_url)]
            bodies = http.get(f"{gateway_url}/bench/bodies").json()
            expected = [http.post(f"{router_url}/generate", json=body).json()["output_ids"] for body in bodies]
            for index in range(WARMUP_SESSIONS):
                client_cpu_s.append(openai_session(client, http, gateway_url))
                session_pairs(http, gateway_url, router_url, bodies, expected, index % 2 == 0)
            cpu_start_s = cpu_seconds(gateway.pid)
            pairs = [pair for index in range(args.sessions)
                     for pair in session_pairs(http, gateway_url, router_url, bodies, expected, index % 2 == 0)]
            gateway_cpu_s = cpu_seconds(gateway.pid) - cpu_start_s
    finally:
        gateway.stop()
        router.stop()
        engine.stop()
    gateway_s, direct_s = [g for g, _ in pairs], [d for _, d in pairs]
    ratios = [g / d - 1 for g, d in pairs]
    figures = {50: median(ratios), 99: percentile(ratios, 99)}
    row = [1e3 * median(direct_s), 1e3 * median(gateway_s), 1e3 * median([g - d for g, d in pairs]),
           1e3 * gateway_cpu_s / len(pairs), figures[50], figures[99], 1e3 * median(client_cpu_s)]
    prompt_tokens = [len(body["input_ids"]) for body in bodies]
    print_table(f"agent gateway overhead per turn: {len(pairs)} turns ({args.sessions} sessions of {NUM_TURNS}), each "
                f"paired with the same /generate sent direct (prompts of {prompt_tokens} tokens, up to {MAX_TOKENS} "
                "generated)",
                ["direct p50 ms", "gateway p50 ms", "added p50 ms", "gateway CPU ms per turn",
                 "overhead p50 (goal <= 0.10)", "overhead p99", "openai client CPU ms per call (untimed sessions)"],
                [row])
    emit({"gateway_overhead_p50": figures[50], "gateway_overhead_p99": figures[99]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
