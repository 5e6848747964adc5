"""Start CPU engine processes for tests and benchmarks, wait for /health, and stop them by their recorded PIDs."""

from __future__ import annotations

from pathlib import Path

import httpx

from services.common import procs


def engine_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def start_engines(model_dir: Path, log_dir: Path, count: int, *args: str,
                  timeout_s: float = 120.0) -> list[tuple[procs.ManagedProcess, str]]:
    """`count` engines on free loopback ports (started together), each answering /health; returns (proc, url)."""
    engines = []
    try:
        for i in range(count):
            port = procs.free_port()
            argv = procs.python_module("services.engine", "--host", procs.HOST, "--port", str(port),
                                       "--model-path", str(model_dir), *args)
            proc = procs.ManagedProcess(f"engine-{i}", argv, log_dir / f"engine-{i}-{port}.log").start()
            engines.append((proc, f"http://{procs.HOST}:{port}"))
        for proc, url in engines:
            proc.wait_ready(lambda u=url: engine_healthy(u), timeout_s=timeout_s)
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: list[tuple[procs.ManagedProcess, str]]) -> None:
    for proc, _ in engines:
        proc.stop()
