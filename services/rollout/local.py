"""The rollout service's public API for running it on one machine (the local stack, tests, benchmarks): start the
sglang-router it sends requests through, and stop the CPU engines a killed manager left running. Nothing else outside
the rollout package needs its internals.
"""

from __future__ import annotations

from pathlib import Path

from services.common import procs
from services.rollout.pool.keyed_launch import keyed_argv
from services.rollout.pool.launchers import LocalLauncher
from services.rollout.pool.router import RouterClient


def start_router(port: int, prometheus_port: int, log_path: Path, policy: str = "round_robin",
                 timeout_s: float = 30.0, env: dict[str, str] | None = None) -> procs.ManagedProcess:
    """Start sglang-router on 127.0.0.1:port; return once GET /liveness answers 200. With a router token in `env`'s
    token directory, its worker list (/workers) admits only that token's holders."""
    argv = keyed_argv("router", "sglang_router.launch_router", "--host", procs.HOST, "--port", str(port),
                      "--prometheus-host", procs.HOST, "--prometheus-port", str(prometheus_port),
                      "--log-level", "warn", "--policy", policy)
    proc = procs.ManagedProcess("sglang-router", argv, Path(log_path), env=dict(env or {})).start()
    client = RouterClient(f"http://{procs.HOST}:{port}", timeout_s=2.0)
    try:
        proc.wait_ready(client.live, timeout_s=timeout_s)
    except Exception:
        proc.stop()
        raise
    finally:
        client.close()
    return proc


def stop_leftover_engines(work_dir: Path, grace_s: float = 10.0) -> list[str]:
    """Stop the engines a killed rollout manager left running in its --work-dir (its engines.json: PID, start time and
    argv checked, so a reused PID is never signalled); returns their names."""
    if not Path(work_dir).is_dir():
        return []
    launcher = LocalLauncher(lambda index, port: [], Path(work_dir), stop_grace_s=grace_s)
    return [engine.name for engine in launcher.stop_leftovers()]
