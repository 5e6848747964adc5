"""The control plane at 64 engines: samples/s through the rollout manager and sglang-router, and the rebuild time of
the weight-update group, with 64 engines simulated in one process (bench/sim_engines.py: one asyncio server per
port, a fixed latency per /generate, a real gloo rank each for the weight group).

`python bench/control_plane.py [--engines 64] [--latency-s 0.02]`. Processes: the simulated engines, Redis, buffer,
reward, sglang-router and the manager (its pool holds the engines as --engine-urls); this process is the trainer:
it starts rollouts (256 prompts x 8 samples, 16 tokens each, scored by exact_match, written to the buffer) and reads
them back, and it is rank 0 of the weight group. The manager sends each group's 8 samples as one /generate (a batch
of input_ids). Also the router alone under the same engines (no manager, a request per sample) driven by three
clients side by side (aiohttp as the manager, httpx with and without keep-alive), and the CPU each process (with the
processes it started: the reward service's workers) used per 1,000 samples: on 2 cores the processes share, that
table says what bounds the figure. Beside the rebuild, 64 reverse lookups at once from this host
(`reverse_lookups_s_64`): what a rebuild would wait for if each engine's store client named the master's address, as
torch's own client does (an SGLang engine joins with it; the CPU engine and the simulated ones do not). Prints the
tables, then one JSON line
(`control_plane_samples_per_s_64`, `group_rebuild_s_64`, `reverse_lookups_s_64`, the router alone, their ratio
`control_plane_vs_router_alone_64`, and the CPU table as `control_plane_cpu_ms_per_1k_samples_64`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import emit, print_table, start_grpc_service, wait_until  # noqa: E402
from physarum import tasks, tinymodel  # noqa: E402
from services.buffer.client import BufferClient  # noqa: E402
from services.common import procs  # noqa: E402
from services.common.settings.rollout import RolloutConfig
from services.rollout.client import EngineState, RolloutClient  # noqa: E402
from services.rollout.engine_calls.router_http import AiohttpPoster, HttpxPoster, Poster  # noqa: E402
from services.rollout.local import start_router  # noqa: E402

JOB = "bench-control-plane"
NEW_TOKENS = 16


def start_sim(work: Path, num_engines: int, latency_s: float) -> tuple[procs.ManagedProcess, list[str]]:
    urls_file = work / "sim-urls.txt"
    argv = [sys.executable, str(Path(__file__).with_name("sim_engines.py")), "--num-engines", str(num_engines),
            "--latency-s", str(latency_s), "--urls-file", str(urls_file)]
    proc = procs.ManagedProcess("sim-engines", argv, work / "sim-engines.log").start()
    wait_until(urls_file.exists, "simulated engines", timeout_s=120)
    return proc, urls_file.read_text().split()


def rebuild_seconds(urls: list[str], repeats: int) -> list[float]:
    """WeightBroadcaster.init_group with every engine: health checks, drop of the old group, all ranks joining.

    The simulated engines join as the CPU engine does, through services/engine/group_store.py, which asks the
    resolver nothing. torch's own store client (an SGLang engine's) names the master's v4-mapped address with
    getnameinfo, a reverse DNS query that /etc/hosts cannot answer: 64 of them at once from one host, where a
    resolver that drops some of a burst makes glibc wait its timeout (5 s by default), and the group waits for that
    rank. The trainer's store makes one such query itself, before the engines join (its own client)."""
    from services.trainer.weight_sync.weight_sync import WeightBroadcaster

    times = []
    with WeightBroadcaster(urls, timeout_s=120.0) as broadcaster:
        for _ in range(repeats):
            start = time.perf_counter()
            broadcaster.init_group()
            times.append(time.perf_counter() - start)
    return times


def reverse_lookup_seconds(num_engines: int, repeats: int) -> list[float]:
    """How long num_engines reverse lookups (getnameinfo) of the master's v4-mapped loopback address take, all at
    once from this host: what torch's store clients ask while they join (rebuild_seconds), so what a rebuild with
    SGLang engines on this host would wait for beyond the join itself."""
    def lookup(i: int) -> None:
        with contextlib.suppress(socket.gaierror):  # a dropped query past the retries: the time is what counts
            socket.getnameinfo(("::ffff:127.0.0.1", 1024 + i, 0, 0), socket.NI_NUMERICSERV)

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(num_engines) as pool:
            list(pool.map(lookup, range(num_engines)))
        times.append(time.perf_counter() - start)
    return times


async def _router_load(router_url: str, concurrency: int, duration_s: float, poster: Poster) -> float:
    """Samples/s through the router alone: `concurrency` workers sending /generate back to back."""
    body = {"input_ids": [5, 6, 7, 8], "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}}
    done, stop_at = 0, time.monotonic() + duration_s
    try:
        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                reply = await poster.post(f"{router_url}/generate", body)
                if reply.status_code != 200:
                    raise RuntimeError(f"router /generate: HTTP {reply.status_code}: {reply.text[:200]}")
                done += 1
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - start)
    finally:
        await poster.aclose()


def router_rates(router_url: str, concurrency: int, duration_s: float) -> dict[str, float]:
    """The router alone under three clients: the manager's (aiohttp, kept-alive connections) and httpx with and
    without keep-alive, side by side."""
    import httpx

    def httpx_poster(keepalive: int) -> Poster:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=keepalive)
        return HttpxPoster(httpx.AsyncClient(timeout=120, limits=limits))

    clients = {"aiohttp, keep-alive (the manager's)": lambda: AiohttpPoster(concurrency, 120.0),
               "httpx, keep-alive": lambda: httpx_poster(concurrency),
               "httpx, a connection per request": lambda: httpx_poster(0)}
    return {name: asyncio.run(_router_load(router_url, concurrency, duration_s, make()))
            for name, make in clients.items()}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process and the processes it started (the reward service's workers) used so
    far, all threads (/proc/PID/stat fields 14 and 15; children from /proc/PID/task/*/children). A child that is
    itself in `pids` (this process started the services) counts for itself only."""
    ticks = os.sysconf("SC_CLK_TCK")
    named = set(pids.values())

    def tree(pid: int) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                        for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
            return 0.0
        return (int(fields[11]) + int(fields[12])) / ticks + sum(tree(c) for c in children if c not in named)
    return {name: tree(pid) for name, pid in pids.items()}


def manager_samples_per_s(rollout: RolloutClient, buffer: BufferClient, num_rollouts: int, prompts: int,
                          n_samples: int, first_id: int = 0) -> list[float]:
    """Samples/s of whole rollouts: start, then read the rollout's groups back from the buffer, as the trainer does."""
    config = RolloutConfig(job_id=JOB, rollout_batch_size=prompts, n_samples_per_prompt=n_samples,
                           rollout_max_response_len=NEW_TOKENS, rm_type="exact_match", lease_timeout_s=120.0)
    rates = []
    for rollout_id in range(first_id, first_id + num_rollouts):
        start = time.perf_counter()
        rollout.start_rollout(config, rollout_id, "0")
        groups = buffer.get_batch(JOB, rollout_id, prompts, timeout_s=300.0)
        rates.append(sum(len(g.samples) for g in groups) / (time.perf_counter() - start))
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--latency-s", type=float, default=0.02, help="each simulated /generate's latency")
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts of 256 x 8 samples (the first is warm-up)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-control-"))
    model = tinymodel.build_tiny_model(work / "model", tasks.corpus())  # the manager's tokenizer
    data = work / "prompts.jsonl"
    data.write_text("".join(f'{{"input": "{i % 100}+{i // 100}=", "label": "{i % 100 + i // 100}"}}\n'
                            for i in range(4096)))
    sim, urls = start_sim(work, args.engines, args.latency_s)
    started = [sim]
    try:
        rebuild = rebuild_seconds(urls, repeats=3)
        print(f"weight group rebuild with {len(urls)} engines: {', '.join(f'{s:.2f}' for s in rebuild)} s", flush=True)
        lookups = reverse_lookup_seconds(len(urls), repeats=3)
        print(f"{len(urls)} reverse lookups at once: {', '.join(f'{s:.2f}' for s in lookups)} s", flush=True)
        redis, redis_url = procs.start_redis(work / "redis", appendfsync="everysec")
        started.append(redis)
        buffer_proc, buffer_addr = start_grpc_service(work, "services.buffer", "--redis-url", redis_url)
        reward_proc, reward_addr = start_grpc_service(work, "services.reward", "--rest-port", "0")
        router_port = procs.free_port()
        router_proc = start_router(router_port, procs.free_port(), work / "router.log")
        started += [buffer_proc, reward_proc, router_proc]
        router_url = f"http://{procs.HOST}:{router_port}"
        manager, manager_addr = start_grpc_service(
            work, "services.rollout", "--buffer-addr", buffer_addr, "--reward-addr", reward_addr, "--router-url",
            router_url, "--model-path", str(model), "--num-engines", "0", "--engine-urls", ",".join(urls),
            "--work-dir", str(work / "manager"), timeout_s=300)
        started.append(manager)
        with RolloutClient(manager_addr, timeout_s=60) as rollout, BufferClient(buffer_addr, timeout_s=60) as buffer:
            wait_until(lambda: rollout.pool_status().count(EngineState.SERVING) == len(urls), "engines serving",
                       timeout_s=300)
            buffer.load_dataset(JOB, str(data), label_key="label")
            manager_samples_per_s(rollout, buffer, 1, 256, 8)  # warm-up: connections, tokenizer, imports
            pids = {"sim engines": sim.pid, "sglang-router": router_proc.pid, "manager": manager.pid,
                    "buffer": buffer_proc.pid, "reward": reward_proc.pid, "redis": redis.pid,
                    "this process (trainer)": os.getpid()}
            cpu_before = cpu_seconds(pids)
            rates = manager_samples_per_s(rollout, buffer, args.rollouts - 1, 256, 8, first_id=1)
            cpu = {name: seconds - cpu_before[name] for name, seconds in cpu_seconds(pids).items()}
        router = router_rates(router_url, 256, 5.0)
    finally:
        for proc in reversed(started):
            proc.stop(grace_s=30)
    best = max(rates)
    samples = 256 * 8 * len(rates)
    print_table(f"CPU per process over the {len(rates)} measured rollouts ({samples} samples; the machine has "
                f"{os.cpu_count()} cores)", ["process", "CPU s", "CPU ms per 1,000 samples"],
                [[name, f"{seconds:.2f}", f"{1e6 * seconds / samples:.0f}"] for name, seconds in cpu.items()]
                + [["all", f"{sum(cpu.values()):.2f}", f"{1e6 * sum(cpu.values()) / samples:.0f}"]])
    print_table(f"control plane with {args.engines} simulated engines ({args.latency_s * 1e3:.0f} ms per /generate, "
                f"{NEW_TOKENS} tokens)", ["figure", "value", "goal"],
                [["manager + router, whole rollouts (256 x 8), samples/s (best)", f"{best:,.0f}", ">= 2,000"],
                 ["  / the router alone (aiohttp, measured next)", f"{best / next(iter(router.values())):.2f}",
                  ">= 0.9"],
                 ["  each rollout, samples/s", ", ".join(f"{r:,.0f}" for r in rates), ""],
                 *[[f"router alone, 256 concurrent /generate, {name}, samples/s", f"{rate:,.0f}", "(reference)"]
                   for name, rate in router.items()],
                 [f"weight-group rebuild at {args.engines} engines, s (best)", f"{min(rebuild):.2f}", "<= 5"],
                 [f"  {args.engines} reverse lookups of ::ffff:127.0.0.1 at once (torch's store client, an SGLang "
                  "engine's, asks one while joining; ours none), s (best)", f"{min(lookups):.2f}", "(reference)"]])
    router_alone = next(iter(router.values()))
    emit({"control_plane_samples_per_s_64": best, "group_rebuild_s_64": min(rebuild),
          "reverse_lookups_s_64": min(lookups),
          "control_plane_router_alone_samples_per_s_64": router_alone,
          "control_plane_vs_router_alone_64": best / router_alone,
          "control_plane_cpu_ms_per_1k_samples_64": {name: round(1e6 * seconds / samples, 1)
                                                     for name, seconds in cpu.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
