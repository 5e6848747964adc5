"""The local stack (`physarum up` / `down`): every service as a process on loopback, started once.

Starts a private redis-server, buffer, reward, the real sglang-router, the rollout manager (which starts the
CPU engines) and the trainer; records each PID and command line in stack.json so `down` stops exactly those.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from physarum.procs import HOST, ManagedProcess, cmdline_of, free_port, python_module, start_redis

log = logging.getLogger(__name__)

DEFAULT_WORK_DIR = Path(".physarum/stack")
STATE_FILE = "stack.json"


@dataclass
class StackOptions:
    work_dir: Path = DEFAULT_WORK_DIR
    model_path: Path | None = None      # the engines' initial weights (a HF directory)
    num_engines: int = 2
    engine_threads: int = 1
    trainer_threads: int = 2
    start_timeout_s: float = 180.0


def _grpc_ready(addr: str):
    from services.common.grpc_client import wait_for_health

    def check() -> bool:
        try:
            wait_for_health(addr, timeout_s=0.5)
            return True
        except TimeoutError:
            return False
    return check


def _http_ready(url: str):
    import httpx

    def check() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False
    return check


def read_state(work_dir: Path = DEFAULT_WORK_DIR) -> dict | None:
    path = Path(work_dir) / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def up(options: StackOptions) -> dict:
    """Start the stack unless it is already up; returns its state (addresses and processes)."""
    from services.rollout.router import start_router

    work_dir = options.work_dir.resolve()
    if (state := read_state(work_dir)) and all_alive(state):
        return state
    if options.model_path is None:
        raise ValueError("up: a model directory is needed for the engines (--model)")
    logs = work_dir / "logs"
    # The local stack is ephemeral: a fresh Redis, so a job id reused across `up`s never meets old groups.
    shutil.rmtree(work_dir / "redis", ignore_errors=True)
    redis, redis_url = start_redis(work_dir / "redis")
    ports = {name: free_port() for name in ("buffer", "reward", "reward_rest", "router", "router_metrics",
                                            "rollout", "trainer", "trainer_rest")}
    addr = {name: f"{HOST}:{port}" for name, port in ports.items()}
    router_url = f"http://{addr['router']}"
    processes = [redis]
    try:
        processes.append(start_router(ports["router"], ports["router_metrics"], logs / "router.log"))
        specs = {
            "buffer": python_module("services.buffer", "--host", HOST, "--port", str(ports["buffer"]),
                                    "--redis-url", redis_url),
            "reward": python_module("services.reward", "--host", HOST, "--port", str(ports["reward"]),
                                    "--rest-port", str(ports["reward_rest"])),
            "rollout": python_module("services.rollout", "--host", HOST, "--port", str(ports["rollout"]),
                                     "--buffer-addr", addr["buffer"], "--reward-addr", addr["reward"],
                                     "--router-url", router_url, "--model-path", str(options.model_path.resolve()),
                                     "--num-engines", str(options.num_engines),
                                     "--engine-num-threads", str(options.engine_threads),
                                     "--work-dir", str(work_dir / "engines")),
            "trainer": python_module("services.trainer", "--host", HOST, "--port", str(ports["trainer"]),
                                     "--rest-port", str(ports["trainer_rest"]), "--buffer-addr", addr["buffer"],
                                     "--rollout-addr", addr["rollout"],
                                     "--num-threads", str(options.trainer_threads)),
        }
        started = {name: ManagedProcess(name, argv, logs / f"{name}.log").start() for name, argv in specs.items()}
        processes.extend(started.values())
        checks = {"buffer": _grpc_ready(addr["buffer"]), "reward": _grpc_ready(addr["reward"]),
                  "rollout": _grpc_ready(addr["rollout"]), "trainer": _grpc_ready(addr["trainer"])}
        for name, check in checks.items():
            started[name].wait_ready(check, timeout_s=options.start_timeout_s)
    except BaseException:
        for proc in reversed(processes):
            proc.stop()
        raise
    state = {
        "work_dir": str(work_dir), "redis_url": redis_url, "router_url": router_url,
        "buffer_addr": addr["buffer"], "reward_addr": addr["reward"], "reward_url": f"http://{addr['reward_rest']}",
        "rollout_addr": addr["rollout"], "trainer_addr": addr["trainer"],
        "trainer_url": f"http://{addr['trainer_rest']}",
        "processes": [{"name": p.name, "pid": p.pid, "argv": p.argv, "log": str(p.log_path)} for p in processes],
    }
    (work_dir / STATE_FILE).write_text(json.dumps(state, indent=2))
    return state


def _owned(entry: dict) -> bool:
    return cmdline_of(entry["pid"])[: len(entry["argv"])] == entry["argv"]


def all_alive(state: dict) -> bool:
    return all(_owned(p) for p in state["processes"])


def down(work_dir: Path = DEFAULT_WORK_DIR, grace_s: float = 20.0) -> list[str]:
    """Stop the processes recorded in stack.json, newest first, each by its PID; returns their names."""
    state = read_state(work_dir)
    if state is None:
        return []
    stopped = []
    for entry in reversed(state["processes"]):
        if not _owned(entry):
            continue
        os.kill(entry["pid"], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _owned(entry) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _owned(entry):
            os.kill(entry["pid"], signal.SIGKILL)
        stopped.append(entry["name"])
    (Path(work_dir) / STATE_FILE).unlink(missing_ok=True)
    return stopped
