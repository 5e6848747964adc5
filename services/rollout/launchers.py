"""How the pool gets engines: one small interface, two implementations (local processes here, Kubernetes pods through
services/rollout/k8s.py). A launcher only starts and stops engines; how many, and which ones leave, the pool decides.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from physarum import procs

log = logging.getLogger(__name__)

EXEC_WAIT_S = 5.0


@dataclass(frozen=True)
class LaunchedEngine:
    name: str  # unique per launcher: "engine-3", or the pod's name
    url: str
    pid: int = 0  # local processes only
    alive: bool = True  # False once a local process has exited (the pool replaces it)


class EngineLauncher(Protocol):
    def engines(self) -> list[LaunchedEngine]:
        """The engines that exist now (started, maybe not yet answering)."""

    def scale(self, replicas: int, remove: Sequence[str] = ()) -> None:
        """Stop the engines named in `remove`, then have `replicas` engines (start new ones or stop the newest)."""

    def close(self) -> None:
        """Stop every engine this launcher started."""


def cpu_engine_argv(model_path: str, *, num_threads: int = 1, per_token_delay_s: float = 0.0,
                    fake_compute: bool = False, weight_sync_timeout_s: float = 60.0) -> Callable[[int, int], list[str]]:
    """argv of the i-th CPU engine on a port (distinct seeds: engines must not draw alike)."""

    def argv(port: int, index: int) -> list[str]:
        return procs.python_module("services.rollout.engine", "--host", procs.HOST, "--port", str(port),
                                   "--model-path", model_path, "--num-threads", str(num_threads), "--seed", str(index),
                                   "--per-token-delay-s", str(per_token_delay_s), "--fake-compute", str(fake_compute),
                                   "--weight-sync-timeout-s", str(weight_sync_timeout_s))
    return argv


class LocalLauncher:
    """Engines as child processes on loopback free ports, each stopped by the PID recorded at start."""

    def __init__(self, argv_for: Callable[[int, int], list[str]], work_dir: Path, *, stop_grace_s: float = 10.0,
                 env: dict[str, str] | None = None) -> None:
        self.argv_for = argv_for
        self.work_dir = Path(work_dir)
        self.stop_grace_s = stop_grace_s
        self.env = env or {}
        self.processes: dict[str, tuple[procs.ManagedProcess, str]] = {}  # name -> (process, url), oldest first
        self.num_started = 0
        self.stoppers: list[threading.Thread] = []

    def engines(self) -> list[LaunchedEngine]:
        return [LaunchedEngine(name, url, proc.pid, proc.alive()) for name, (proc, url) in self.processes.items()]

    def scale(self, replicas: int, remove: Sequence[str] = ()) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        for name in remove:
            if name in self.processes:
                self._stop(name)
        while len(self.processes) > replicas:
            self._stop(next(reversed(self.processes)))
        while len(self.processes) < replicas:
            self._start()

    def _start(self) -> None:
        index, port = self.num_started, procs.free_port()
        self.num_started += 1
        name = f"engine-{index}"
        proc = procs.ManagedProcess(name, self.argv_for(port, index), self.work_dir / f"{name}-{port}.log",
                                    env=self.env).start()
        self.processes[name] = (proc, f"http://{procs.HOST}:{port}")
        log.info("started %s (pid %d) on port %d, log %s", name, proc.pid, port, proc.log_path)

    def _stop(self, name: str) -> None:
        """Forget `name` now and stop it in the background (SIGTERM, SIGKILL after the grace period)."""
        proc, url = self.processes.pop(name)

        def stop() -> None:
            deadline = time.monotonic() + EXEC_WAIT_S  # a child not yet exec'd does not show its argv: wait for it
            while proc.alive() and not proc.owns_pid() and time.monotonic() < deadline:
                time.sleep(0.01)
            code = proc.stop(self.stop_grace_s)
            log.info("stopped %s (pid %d, %s), exit code %s", name, proc.pid, url, code)

        thread = threading.Thread(target=stop, name=f"stop-{name}", daemon=True)
        thread.start()
        self.stoppers = [t for t in self.stoppers if t.is_alive()] + [thread]

    def close(self) -> None:
        for name in list(self.processes):
            self._stop(name)
        for thread in self.stoppers:
            thread.join(self.stop_grace_s * 2 + 5)
        self.stoppers = []


class KubernetesLauncher:
    """KubernetesEngineLauncher (k8s.py) behind the pool's interface: ready pods of the engine Deployment are its
    engines and `scale` patches the Deployment's replicas. Kubernetes chooses which pod a scale-down removes, and
    replaces a failed pod through its liveness probe, so `remove` is not honoured; a pod removed while serving only
    costs its in-flight requests a retry on another engine."""

    def __init__(self, k8s) -> None:
        self.k8s = k8s

    def engines(self) -> list[LaunchedEngine]:
        self.k8s.engine_urls()
        return [LaunchedEngine(pod, url) for pod, url in sorted(self.k8s.ready.items())]

    def scale(self, replicas: int, remove: Sequence[str] = ()) -> None:
        if remove:
            log.info("kubernetes: scaling to %d; the ReplicaSet picks the pods to stop (asked: %s)", replicas,
                     ", ".join(remove))
        self.k8s.scale(replicas)

    def close(self) -> None:
        self.k8s.close()
