"""What the hop benchmarks share: starting services and engines as processes, timing, and printing the table of
ratios and the final JSON line. The benchmarks themselves live in one script per hop (bench/*.py)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common import procs  # noqa: E402

ENGINE_MODULE = "services.engine"  # the CPU engine's package (python -m ...)


def machine() -> str:
    """One line: CPU model, cores, memory, OS, Python and torch versions, and the load when measured."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    mem_kb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")))
    load = os.getloadavg()[0]
    return (f"{cpu}, {os.cpu_count()} cores, {mem_kb / 2**20:.0f} GiB, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, load average {load:.2f}")


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 300.0, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s")
        time.sleep(interval_s)


def http_ok(url: str) -> Callable[[], bool]:
    import httpx

    def check() -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False
    return check


def start_engine(work: Path, model: Path, name: str, *args: str, num_threads: int = 1,
                 timeout_s: float = 300.0) -> tuple[procs.ManagedProcess, str]:
    """A CPU engine process on a free port serving `model`; returns it and its URL once /health answers."""
    port = procs.free_port()
    argv = procs.python_module(ENGINE_MODULE, "--host", procs.HOST, "--port", str(port), "--model-path", str(model),
                               "--num-threads", str(num_threads), *args)
    proc = procs.ManagedProcess(name, argv, work / f"{name}.log").start()
    url = f"http://{procs.HOST}:{port}"
    proc.wait_ready(http_ok(f"{url}/health"), timeout_s=timeout_s)
    return proc, url


def start_grpc_service(work: Path, module: str, *args: str, timeout_s: float = 120.0) -> tuple[procs.ManagedProcess,
                                                                                               str]:
    """`python -m module --host --port ...` on a free port; returns it and its address once gRPC health answers."""
    from services.common.grpc_client import wait_for_health

    port = procs.free_port()
    proc = procs.ManagedProcess(module, procs.python_module(module, "--host", procs.HOST, "--port", str(port), *args),
                                work / f"{module}.log").start()
    addr = f"{procs.HOST}:{port}"

    def ready() -> bool:
        try:
            wait_for_health(addr, timeout_s=0.5)
            return True
        except TimeoutError:
            return False
    proc.wait_ready(ready, timeout_s=timeout_s)
    return proc, addr


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls, in seconds (the least disturbed by other load on a shared machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A Markdown table (the RESULTS.md format), numbers to 3 significant digits."""
    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(cell(v) for v in row) + " |")
    print(flush=True)


def emit(figures: dict[str, float | None]) -> None:
    """The script's last line: its figures under the issue's keys."""
    print(json.dumps(figures), flush=True)


def run_job(trainer_url: str, spec: dict, timeout_s: float) -> list[dict]:
    """Submit `spec` through the trainer's REST API, wait for the end (cancelling the job past timeout_s), return
    its events; raise unless it SUCCEEDED."""
    from services.trainer.api.client import TERMINAL_STATES, JobsRestClient

    with JobsRestClient(trainer_url, timeout_s=30) as client:
        job = client.submit(spec)
        what = f"job {job['job_id']}" + (f" ({spec['mode']})" if "mode" in spec else "")
        deadline = time.monotonic() + timeout_s
        while (job := client.get(job["job_id"]))["state"] not in TERMINAL_STATES:
            if time.monotonic() > deadline:
                client.cancel(job["job_id"])
                raise TimeoutError(f"{what} still {job['state']} at rollout {job['rollout_id']} after "
                                   f"{timeout_s:.0f} s; cancelled")
            time.sleep(0.5)
        if job["state"] != "SUCCEEDED":
            raise RuntimeError(f"{what} {job['state']}: {job['error']}")
        return client.events(job["job_id"])


def build_sync_model(work: Path) -> Path:
    """The weight-sync benchmarks' model: a 28-layer, 384-wide tiny Qwen3, 310 tensors, about 250 MB in fp32."""
    from physarum import tasks, tinymodel

    return tinymodel.build_tiny_model(work / "sync-model", tasks.corpus(), num_layers=28, hidden_size=384)


def named_weights(model_dir: Path) -> list:
    """The model's tensors by HF name, as the trainer hands them to the broadcast."""
    from safetensors.torch import load_file

    return sorted(load_file(model_dir / "model.safetensors").items())


def start_sync_bench(parser: argparse.ArgumentParser, argv: list[str] | None,
                     prefix: str) -> tuple[argparse.Namespace, Path, Path, list]:
    """A weight-sync benchmark's start: add --rounds to `parser` and parse `argv`, keep torch to one thread here,
    build the sync model in a new work dir; returns (args, work dir, model dir, named weights)."""
    import torch

    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    model = build_sync_model(work)
    return args, work, model, named_weights(model)
