"""The router's overhead on /generate: the same requests through sglang-router and straight to the engine.

`python bench/router_overhead.py [--requests 200]`. One CPU engine (the demo's tiny model) and the real sglang-router
run as processes; requests alternate, one at a time, between the router and the engine, so both see the same load.
Overhead = (router latency - direct latency) / direct latency, at p50 and p99, for the demo's short answers and for
longer ones; also the time the router added to each pair of requests (router minus direct, sent back to back), and
how many connections to the engine were closed during the run (TIME_WAIT sockets on its port): a count near zero
says the connections are kept alive, so a p99 gap is the machine's scheduling noise, not connection set-up.
Prints a table, then one JSON line (`router_overhead_p50`, `router_overhead_p99`: the demo's requests).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, percentile, print_table, start_engine  # noqa: E402
from physarum import tasks, tinymodel  # noqa: E402
from services.common import procs  # noqa: E402
from services.rollout.local import start_router  # noqa: E402
from services.rollout.pool.router import RouterClient  # noqa: E402


def closed_connections(port: int) -> int:
    """TCP sockets in TIME_WAIT with `port` at either end (each one a connection that was closed)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            ports = {int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)}
            count += fields[3] == "06" and port in ports
    return count


def latencies(http, urls: dict[str, str], body: dict, num_requests: int) -> dict[str, list[float]]:
    """Seconds per request on each side, the sides interleaved request by request."""
    out: dict[str, list[float]] = {side: [] for side in urls}
    for i in range(num_requests + 5):  # the first 5 rounds warm both up and are left out
        for side, url in urls.items():
            start = time.perf_counter()
            reply = http.post(f"{url}/generate", json=body)
            elapsed = time.perf_counter() - start
            reply.raise_for_status()
            if i >= 5:
                out[side].append(elapsed)
    return out


def main(argv: list[str] | None = None) -> int:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200, help="requests per side and length")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-router-"))
    model = tinymodel.build_tiny_model(work / "model", tasks.corpus())
    engine, engine_url = start_engine(work, model, "engine")
    router_port = procs.free_port()
    router = start_router(router_port, procs.free_port(), work / "router.log")
    router_url = f"http://{procs.HOST}:{router_port}"
    rows, figures = [], {}
    try:
        with RouterClient(router_url, timeout_s=10.0) as admin:
            admin.add_worker(engine_url, timeout_s=60.0)
        engine_port = int(engine_url.rsplit(":", 1)[1])
        closed_before = closed_connections(engine_port)
        with httpx.Client(timeout=60.0) as http:
            for label, max_new_tokens in (("demo (4 tokens)", 4), ("64 tokens", 64)):
                body = {"input_ids": [5, 6, 7, 8, 9, 10], "return_logprob": True,
                        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                            "ignore_eos": True}}
                times = latencies(http, {"direct": engine_url, "router": router_url}, body, args.requests)
                row = [label]
                for q in (50, 99):
                    direct, routed = percentile(times["direct"], q), percentile(times["router"], q)
                    figures[(label, q)] = (routed - direct) / direct
                    row += [1e3 * direct, 1e3 * routed, figures[(label, q)]]
                added = [routed - direct for direct, routed in zip(times["direct"], times["router"], strict=True)]
                rows.append(row + [f"{1e3 * percentile(added, 50):.2f} / {1e3 * percentile(added, 99):.2f}"])
        closed = closed_connections(engine_port) - closed_before
    finally:
        router.stop()
        engine.stop()
    print_table(f"router overhead on /generate, {args.requests} requests per side, one at a time",
                ["answer", "direct p50 ms", "router p50 ms", "overhead p50 (goal <= 0.05)", "direct p99 ms",
                 "router p99 ms", "overhead p99 (goal <= 0.05)", "added per pair p50 / p99 ms"], rows)
    print(f"connections to the engine closed during the {4 * args.requests} requests: {max(closed, 0)}")
    emit({"router_overhead_p50": figures[("demo (4 tokens)", 50)],
          "router_overhead_p99": figures[("demo (4 tokens)", 99)],
          "router_overhead_p50_64_tokens": figures[("64 tokens", 50)],
          "router_overhead_p99_64_tokens": figures[("64 tokens", 99)]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
