"""How the pool gets engines: one small interface, two implementations (local processes here, Kubernetes pods through
k8s.py beside this file). A launcher only starts and stops engines; how many, and which ones leave, the pool decides.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.common import procs
from services.common.errors import FailedPrecondition
from services.rollout.pool.sglang_launcher import sglang_server_args

log = logging.getLogger(__name__)

EXEC_WAIT_S = 5.0
RECORD_FILE = "engines.json"
GONE_WAIT_S = 5.0  # after SIGKILL, until /proc no longer shows the leftover


@dataclass(frozen=True)
class LaunchedEngine:
    name: str  # unique per launcher: "engine-3", or the pod's name
    url: str
    pid: int = 0  # local processes only
    alive: bool = True  # False once a local process has exited (the pool replaces it)


class EngineLauncher(Protocol):
    """A launcher whose engines can outlive a killed manager (local processes) also has `stop_leftovers()`, which the
    pool calls once before it starts any engine."""

    def engines(self) -> list[LaunchedEngine]:
        """The engines that exist now (started, maybe not yet answering)."""

    def scale(self, replicas: int, remove: Sequence[str] = ()) -> None:
        """Stop the engines named in `remove`, then have `replicas` engines (start new ones or stop the newest)."""

    def close(self) -> None:
        """Stop every engine this launcher started."""


# SGLang server options the CPU engine has, under SGLang's names (its /server_info reports them the same way)
CPU_ENGINE_OPTIONS = {"sglang_dtype": "--dtype", "sglang_enable_lora": "--enable-lora",
                      "sglang_max_loras_per_batch": "--max-loras-per-batch", "sglang_max_lora_rank": "--max-lora-rank",
                      "sglang_lora_target_modules": "--lora-target-modules"}


def _argument(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def cpu_engine_options_argv(options: Mapping[str, Any]) -> list[str]:
    """A job's engine options as CPU engine arguments: those it has (CPU_ENGINE_OPTIONS); the rest do not apply."""
    return [arg for key, flag in CPU_ENGINE_OPTIONS.items() if key in options
            for arg in (flag, _argument(options[key]))]


def cpu_engine_argv(model_path: str, *, num_threads: int = 1, per_token_delay_s: float = 0.0,
                    fake_compute: bool = False, weight_sync_timeout_s: float = 60.0,
                    device: str = "cpu") -> Callable[[int, int], list[str]]:
    """argv of the i-th CPU engine on a port (distinct seeds: engines must not draw alike)."""

    def argv(port: int, index: int) -> list[str]:
        return procs.python_module("services.engine", "--host", procs.HOST, "--port", str(port),
                                   "--model-path", model_path, "--num-threads", str(num_threads), "--seed", str(index),
                                   "--per-token-delay-s", str(per_token_delay_s), "--fake-compute", str(fake_compute),
                                   "--weight-sync-timeout-s", str(weight_sync_timeout_s), "--device", device,
                                   # adapters cost nothing until loaded; LoRA jobs then need no relaunch
                                   *(() if fake_compute else ("--enable-lora", "true")))
    return argv


class LocalLauncher:
    """Engines as child processes on loopback free ports, each stopped by the PID recorded at start.

    Engines run in their own sessions, so they outlive a SIGKILLed manager, still registered with the router. The
    launcher therefore keeps work_dir/engines.json (PID, start time, argv, URL of each engine it runs) up to date,
    and a new launcher in the same work dir stops those leftovers (`stop_leftovers`). One manager per work dir.
    """

    def __init__(self, argv_for: Callable[[int, int], list[str]], work_dir: Path, *, stop_grace_s: float = 10.0,
                 env: dict[str, str] | None = None,
                 options_argv: Callable[[Mapping[str, Any]], list[str]] | None = None) -> None:
        self.argv_for = argv_for
        self.options_argv = options_argv  # a job's engine options -> engine arguments (None: it takes none)
        self.extra_argv: list[str] = []  # appended to each new engine's argv: the last of a repeated flag wins
        self.work_dir = Path(work_dir)
        self.stop_grace_s = stop_grace_s
        self.env = env or {}
        self.processes: dict[str, tuple[procs.ManagedProcess, str]] = {}  # name -> (process, url), oldest first
        self.recorded: dict[str, dict] = {}  # name -> its engines.json entry, from its start until it is stopped
        self.num_started = 0
        self.stoppers: list[threading.Thread] = []
        self.record_path = self.work_dir / RECORD_FILE
        self.record_lock = threading.Lock()
        self.owner = {"pid": os.getpid(), "start_time": procs.start_time(os.getpid())}

    def engines(self) -> list[LaunchedEngine]:
        return [LaunchedEngine(name, url, proc.pid, proc.alive()) for name, (proc, url) in self.processes.items()]

    @property
    def takes_options(self) -> bool:
        return self.options_argv is not None

    def set_engine_options(self, options: Mapping[str, Any]) -> bool:
        """Start engines with these server options from now on; False: the pool replaces the running ones."""
        self.extra_argv = self.options_argv(options)
        return False

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
        proc = procs.ManagedProcess(name, self.argv_for(port, index) + self.extra_argv,
                                    self.work_dir / f"{name}-{port}.log", env=self.env).start()
        url = f"http://{procs.HOST}:{port}"
        self.processes[name] = (proc, url)
        # The start time now, while the PID is surely this child's (Popen returns once it has exec'd).
        self._record(name, {"name": name, "pid": proc.pid, "start_time": procs.start_time(proc.pid),
                            "argv": proc.argv, "url": url})
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
            self._record(name, None)

        thread = threading.Thread(target=stop, name=f"stop-{name}", daemon=True)
        thread.start()
        self.stoppers = [t for t in self.stoppers if t.is_alive()] + [thread]

    def close(self) -> None:
        for name in list(self.processes):
            self._stop(name)
        for thread in self.stoppers:
            thread.join(self.stop_grace_s * 2 + 5)
        self.stoppers = []

    def _record(self, name: str, entry: dict | None) -> None:
        """Record engine `name` (entry None: forget it) in engines.json."""
        with self.record_lock:
            if entry is None:
                self.recorded.pop(name, None)
            else:
                self.recorded[name] = entry
            self._write_record()

    def _write_record(self) -> None:
        """Rewrite engines.json atomically (a manager killed mid-write leaves the previous one); hold record_lock."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.record_path.with_name(f".{RECORD_FILE}.tmp")
        tmp.write_text(json.dumps({"owner": self.owner, "engines": list(self.recorded.values())}, indent=2))
        os.replace(tmp, self.record_path)

    def stop_leftovers(self) -> list[LaunchedEngine]:
        """The engines engines.json records from an earlier launcher in this work dir (its manager was killed): stop
        those that still run, by PID, only when start time and command line match the record (a reused PID is never
        signalled); returns all of them, for the pool to remove their URLs from the router. FailedPrecondition when
        the process that wrote the record still runs."""
        try:
            record = json.loads(self.record_path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            log.warning("ignoring %s, unreadable: %s", self.record_path, err)
            return []
        owner = record.get("owner", {})
        if owner.get("pid") != os.getpid() and _still_runs(owner):
            raise FailedPrecondition(f"engine work dir {self.work_dir} belongs to process {owner['pid']}, which still "
                                     f"runs: give each rollout manager its own --work-dir")
        leftovers = [LaunchedEngine(e["name"], e["url"], e["pid"], alive=False) for e in record.get("engines", [])]
        threads = [threading.Thread(target=_stop_leftover, args=(e, self.stop_grace_s), daemon=True,
                                    name=f"stop-leftover-{e['name']}") for e in record.get("engines", [])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.stop_grace_s + GONE_WAIT_S + 5)
        with self.record_lock:  # the leftovers are gone: from now on the record lists this launcher's engines
            self._write_record()
        return leftovers


def _still_runs(entry: dict) -> bool:
    """The process recorded in `entry` (pid, start_time and, for an engine, argv) is still that process."""
    pid, started = entry.get("pid"), entry.get("start_time")
    if not pid or started is None or procs.start_time(pid) != started:
        return False
    return "argv" not in entry or procs.cmdline_of(pid) == entry["argv"]


def _stop_leftover(entry: dict, grace_s: float) -> None:
    """SIGTERM a recorded engine that still runs, SIGKILL after grace_s; returns once it is gone (or a timeout)."""
    what = f"leftover {entry['name']} (pid {entry['pid']}, {entry['url']})"
    pid, started = entry["pid"], entry.get("start_time")
    ended = None
    if _still_runs(entry):  # PID, start time and command line: the engine, not a process that reuses its PID
        # signalled, PID and start time alone name it: an exiting process (or one that exec'd) has another command
        # line before it is gone, and a wait on all three would end while it still runs
        ended = procs.terminate(pid, lambda: procs.start_time(pid) == started, grace_s, kill_wait_s=GONE_WAIT_S)
    if ended is None:
        log.info("%s: no longer runs", what)
    elif ended:
        log.info("%s stopped (%s)", what, ended)
    else:
        log.warning("%s still runs after SIGKILL", what)


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

    takes_options = True

    def set_engine_options(self, options: Mapping[str, Any]) -> bool:
        """Set the options on the engine container's args; the Deployment's rolling update replaces the pods."""
        self.k8s.set_engine_args(sglang_server_args(options))
        return True

    def scale(self, replicas: int, remove: Sequence[str] = ()) -> None:
        if remove:
            log.info("kubernetes: scaling to %d; the ReplicaSet picks the pods to stop (asked: %s)", replicas,
                     ", ".join(remove))
        self.k8s.scale(replicas)

    def close(self) -> None:
        self.k8s.close()
