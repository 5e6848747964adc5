"""The engine pool, one owner: local CPU engine processes it starts plus already-running engines, all registered
with the router only once they answer /health. It knows nothing of prompts or samples.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path

from physarum import procs
from services.common.errors import DeadlineExceeded, PhysarumError, Unavailable
from services.common.sglang import SGLangClient
from services.rollout.client import EngineInfo
from services.rollout.router import RouterClient

log = logging.getLogger(__name__)


class EnginePool:
    """Starts `num_engines` local engines, registers them and `engine_urls` with the router, stops what it started."""

    def __init__(self, router: RouterClient, *, model_path: str = "", num_engines: int = 0,
                 engine_urls: list[str] | None = None, num_threads: int = 1, start_timeout_s: float = 120.0,
                 work_dir: str = "") -> None:
        self.router = router
        self.model_path = model_path
        self.num_engines = num_engines
        self.external_urls = [u.rstrip("/") for u in engine_urls or []]
        self.num_threads = num_threads
        self.start_timeout_s = start_timeout_s
        self.work_dir = Path(work_dir) if work_dir else None
        self.processes: dict[str, procs.ManagedProcess] = {}  # url -> the local engine this pool started
        self.stopping = threading.Event()  # set from another thread: a start() in progress gives up

    @property
    def urls(self) -> list[str]:
        return [*self.processes, *self.external_urls]

    def start(self) -> None:
        """Start the local engines (in parallel), wait for /health, register every engine; stop all on failure."""
        work_dir = self.work_dir or Path(tempfile.mkdtemp(prefix="physarum-rollout-"))
        try:
            for i in range(self.num_engines):
                port = procs.free_port()
                argv = procs.python_module("services.rollout.engine", "--host", procs.HOST, "--port", str(port),
                                           "--model-path", self.model_path, "--num-threads", str(self.num_threads),
                                           "--seed", str(i))  # distinct seeds: engines must not draw alike
                proc = procs.ManagedProcess(f"engine-{i}", argv, work_dir / f"engine-{i}-{port}.log").start()
                self.processes[f"http://{procs.HOST}:{port}"] = proc
                log.info("started engine %d (pid %d) on port %d, log %s", i, proc.pid, port, proc.log_path)
            self._wait_router()
            for url, proc in self.processes.items():
                with SGLangClient(url, timeout_s=5.0) as engine:
                    proc.wait_ready(lambda e=engine: self._check_stopping() or e.health(timeout_s=5.0),
                                    timeout_s=self.start_timeout_s)
                self.router.add_worker(url, timeout_s=self.start_timeout_s)
                log.info("engine %s registered with router %s", url, self.router.url)
            for url in self.external_urls:
                self._wait_health(url)
                self.router.add_worker(url, timeout_s=self.start_timeout_s)
                log.info("external engine %s registered with router %s", url, self.router.url)
        except BaseException:
            self.stop()
            raise

    def _check_stopping(self) -> bool:
        if self.stopping.is_set():
            raise Unavailable("engine pool: stopped while starting")
        return False

    def _wait_router(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self._check_stopping() and not self.router.live():
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"router {self.router.url}: no /liveness reply in {self.start_timeout_s} s")
            time.sleep(0.2)

    def _wait_health(self, url: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        with SGLangClient(url, timeout_s=5.0) as engine:
            while not self._check_stopping() and not engine.health(timeout_s=5.0):
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(f"engine {url}: no /health reply in {self.start_timeout_s} s")
                time.sleep(0.5)

    def engines(self) -> list[EngineInfo]:
        """Every engine of the pool with its current weight version (/model_info) and health."""
        infos = []
        for url in self.urls:
            with SGLangClient(url, timeout_s=2.0) as engine:
                try:
                    version = engine.weight_version()
                except PhysarumError:
                    version = ""
                infos.append(EngineInfo(url=url, weight_version=version, healthy=engine.health(timeout_s=2.0)))
        return infos

    def stop(self, grace_s: float = 10.0) -> None:
        """Deregister the local engines, then stop each process by the PID this pool recorded (not thread-safe
        with start(): set `stopping`, wait for start() to return, then call this)."""
        for url, proc in self.processes.items():
            try:
                if self.router.find_worker(url) is not None:
                    self.router.remove_worker(url, timeout_s=2.0)
            except PhysarumError as err:
                log.warning("engine %s: could not deregister from router: %s", url, err)
            code = proc.stop(grace_s)
            log.info("engine %s (pid %d) stopped, exit code %s", url, proc.pid, code)
        self.processes.clear()
