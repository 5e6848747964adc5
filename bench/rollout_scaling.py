"""How the rollout pool scales: samples/s by engine count (CPU engines, and fake-compute engines for the control plane
up to 64), weight-update group rebuild time by engine count, join time of a new engine by both paths (a snapshot from
disk, or the next broadcast), and the resident memory of the manager and the router at 64 engines.

`python bench/rollout_scaling.py [--cpu-engines 1,2,4,8] [--fake-engines 1,2,4,8,16,32,64]`. The manager and the
router run as processes; this process is the load generator and the trainer (rank 0 of the weight sync). Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from physarum import tasks, tinymodel  # noqa: E402
from services.common import procs  # noqa: E402
from services.common.grpc_client import wait_for_health  # noqa: E402
from services.rollout.client import EngineState, RolloutClient  # noqa: E402
from services.rollout.local import start_router  # noqa: E402

MAX_NEW_TOKENS = 16


class Manager:
    """A rollout manager process in front of its own sglang-router."""

    def __init__(self, work: Path, model: Path, name: str, *args: str) -> None:
        self.router_port, port = procs.free_port(), procs.free_port()
        self.router = start_router(self.router_port, procs.free_port(), work / f"{name}-router.log")
        self.router_url = f"http://{procs.HOST}:{self.router_port}"
        argv = procs.python_module(
            "services.rollout", "--host", procs.HOST, "--port", str(port), "--router-url", self.router_url,
            "--model-path", str(model), "--num-engines", "1", "--work-dir", str(work / name),
            "--weight-snapshot-dir", str(work / name / "snapshots"), "--health-check-interval-s", "5",
            "--health-check-timeout-s", "30", "--engine-start-timeout-s", "600", *args)
        self.proc = procs.ManagedProcess(name, argv, work / f"{name}.log").start()
        wait_for_health(f"{procs.HOST}:{port}", timeout_s=600)
        self.client = RolloutClient(f"{procs.HOST}:{port}", timeout_s=60)

    def scale(self, replicas: int, timeout_s: float = 900.0):
        self.client.scale(replicas)
        deadline = time.monotonic() + timeout_s
        while (status := self.client.pool_status()).count(EngineState.SERVING) != replicas or len(
                status.engines) != replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{replicas} engines not serving after {timeout_s} s: {status}")
            time.sleep(0.2)
        return status

    def rss_mb(self) -> dict[str, float]:
        return {"manager": rss_mb(self.proc.pid), "router": rss_mb(self.router.pid)}

    def stop(self) -> None:
        self.client.close()
        self.proc.stop(grace_s=120)
        self.router.stop()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _load(router_url: str, concurrency: int, duration_s: float) -> float:
    """Samples/s through the router: `concurrency` workers sending /generate back to back for `duration_s`."""
    done, stop_at = 0, time.monotonic() + duration_s
    body = {"input_ids": [5, 6, 7, 8], "return_logprob": True,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}}
    # No keep-alive: httpx's reused connections to sglang-router 0.3.2 stall for seconds past ~64 concurrent requests
    # (aiohttp, or a connection per request, reach the engines' rate); this measures the pool, not that stall.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=router_url, timeout=120, limits=limits) as http:
        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                reply = await http.post("/generate", json=body)
                reply.raise_for_status()
                done += 1
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - start)


def throughput(router_url: str, num_engines: int, per_engine: int, duration_s: float) -> float:
    return asyncio.run(_load(router_url, max(4, per_engine * num_engines), duration_s))


def engine_weights(model: Path):
    from safetensors.torch import load_file

    return sorted(load_file(model / "model.safetensors").items())


def join_seconds(status, name: str) -> float:
    """The pool's own measure: from the engine's first /health answer to serving (the join event)."""
    detail = [e.detail for e in status.events if e.kind == "join" and e.engine == name][-1]
    return float(detail.split(") ")[-1].split(" s after")[0])


def bench_fake(work: Path, model: Path, counts: list[int], duration_s: float) -> dict:
    manager = Manager(work, model, "fake", "--engine-fake-compute", "true", "--engine-per-token-delay-s", "0.02")
    rows, scale_s = {}, {}
    try:
        for n in counts:
            start = time.monotonic()
            manager.scale(n)
            scale_s[n] = time.monotonic() - start
            rows[n] = throughput(manager.router_url, n, 8, duration_s)
            print(f"  fake engines {n:>3}: {rows[n]:8.1f} samples/s (ideal {n * 8 / (MAX_NEW_TOKENS * 0.02):.0f}), "
                  f"scaled up in {scale_s[n]:.1f} s", flush=True)
        rss = manager.rss_mb()
    finally:
        manager.stop()
    return {"samples_per_s": rows, "scale_s": scale_s, "rss_mb": rss, "at_engines": counts[-1]}


def bench_cpu(work: Path, model: Path, counts: list[int], duration_s: float) -> dict:
    """CPU engines, disk join: throughput and group rebuild by count, each new engine's join time."""
    from services.trainer.weight_sync.weight_sync import WeightBroadcaster, sync_engine_pool

    manager = Manager(work, model, "cpu-disk", "--engine-join-mode", "disk")
    weights = engine_weights(model)
    rows, rebuild, joins, snapshot_s = {}, {}, [], []
    try:
        with WeightBroadcaster([], timeout_s=60) as broadcaster:
            for n in counts:
                before = {e.name for e in manager.client.pool_status().engines}
                status = manager.scale(n)
                joins += [join_seconds(status, e.name) for e in status.engines if e.name not in before and before]
                broadcaster.set_engines([e.url for e in status.engines])
                start = time.monotonic()
                broadcaster.init_group()
                rebuild[n] = time.monotonic() - start
                stats = sync_engine_pool(broadcaster, manager.client, weights, f"v{n}")
                snapshot_s.append(stats["snapshot_seconds"])
                rows[n] = throughput(manager.router_url, n, 8, duration_s)
                print(f"  cpu engines {n:>3}: {rows[n]:8.1f} samples/s, group rebuild {rebuild[n]:.2f} s, "
                      f"broadcast {stats['seconds']:.2f} s", flush=True)
    finally:
        manager.stop()
    return {"samples_per_s": rows, "group_rebuild_s": rebuild, "disk_join_s": joins,
            "snapshot_write_s": statistics.fmean(snapshot_s)}


def bench_sync_join(work: Path, model: Path, repeats: int) -> list[float]:
    """CPU engines, sync join: the time from the next sync's start to the new engine serving (group rebuild with the
    newcomer, broadcast, registration); the wait for that sync comes on top."""
    from services.trainer.weight_sync.weight_sync import WeightBroadcaster, sync_engine_pool

    manager = Manager(work, model, "cpu-sync", "--engine-join-mode", "sync")
    weights, times = engine_weights(model), []
    try:
        with WeightBroadcaster([], timeout_s=60) as broadcaster:
            sync_engine_pool(broadcaster, manager.client, weights, "v0")
            for i in range(repeats):
                manager.client.scale(2)
                while not any(e.state == EngineState.JOINING for e in manager.client.pool_status().engines):
                    time.sleep(0.1)
                start = time.monotonic()
                sync_engine_pool(broadcaster, manager.client, weights, f"v{i + 1}")
                manager.scale(2)
                times.append(time.monotonic() - start)
                print(f"  sync join {i}: {times[-1]:.2f} s", flush=True)
                manager.scale(1)
    finally:
        manager.stop()
    return times


def counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cpu-engines", type=counts, default=[1, 2, 4, 8])
    parser.add_argument("--fake-engines", type=counts, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--duration-s", type=float, default=5.0, help="load per measurement")
    parser.add_argument("--sync-join-repeats", type=int, default=2)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="physarum-bench-"))
    model = tinymodel.build_tiny_model(work / "tiny-model", tasks.corpus())
    print("fake-compute engines (0.02 s per token, 16 tokens):", flush=True)
    fake = bench_fake(work, model, args.fake_engines, args.duration_s)
    print("CPU engines (tiny Qwen3, 1 thread each, 16 tokens):", flush=True)
    cpu = bench_cpu(work, model, args.cpu_engines, args.duration_s)
    sync_join = bench_sync_join(work, model, args.sync_join_repeats)
    disk_join = statistics.fmean(cpu["disk_join_s"]) if cpu["disk_join_s"] else float("nan")
    sync_mean = statistics.fmean(sync_join)
    print(f"\n{'engines':>8} {'cpu samples/s':>14} {'fake samples/s':>15} {'fake scale-up s':>16} "
          f"{'group rebuild s':>16}")
    for n in sorted(set(args.cpu_engines) | set(args.fake_engines)):
        values = [cpu["samples_per_s"].get(n), fake["samples_per_s"].get(n), fake["scale_s"].get(n),
                  cpu["group_rebuild_s"].get(n)]
        cells = ["" if v is None else f"{v:.1f}" if i < 3 else f"{v:.3f}" for i, v in enumerate(values)]
        print(f"{n:>8} {cells[0]:>14} {cells[1]:>15} {cells[2]:>16} {cells[3]:>16}")
    print("\njoin of a new engine (from its first /health answer to serving):")
    print(f"  disk  (latest snapshot, at once):    {disk_join:.2f} s   (trainer writes a snapshot per sync: "
          f"{cpu['snapshot_write_s']:.3f} s)")
    print(f"  sync  (next broadcast, group rebuilt): {sync_mean:.2f} s   + the wait for the next sync (up to a "
          f"rollout)")
    print(f"resident memory at {fake['at_engines']} engines: manager {fake['rss_mb']['manager']:.0f} MB, "
          f"router {fake['rss_mb']['router']:.0f} MB")
    faster = "disk" if disk_join <= sync_mean else "sync"
    print(f"faster join: {faster} (the default engine_join_mode)")
    print(json.dumps({"cpu_samples_per_s": cpu["samples_per_s"], "fake_samples_per_s": fake["samples_per_s"],
                      "fake_scale_up_s": fake["scale_s"],
                      "group_rebuild_s": cpu["group_rebuild_s"], "join_s": {"disk": disk_join, "sync": sync_mean},
                      "snapshot_write_s": cpu["snapshot_write_s"], "rss_mb_at_max_engines": fake["rss_mb"],
                      "max_engines": fake["at_engines"], "faster_join": faster}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
