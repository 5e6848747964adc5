"""LocalLauncher with real (stand-in) processes: starts to a count, stops the named ones and the newest by the PIDs it
recorded, reports exited ones as not alive, and stops everything on close."""

from __future__ import annotations

import signal
import sys
import time

from physarum import procs
from services.rollout.launchers import LocalLauncher


def sleeper(port: int, index: int) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep(120)  # engine {index} on port {port}"]


def wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while procs.cmdline_of(pid):
        assert time.monotonic() < deadline, f"pid {pid} still running"
        time.sleep(0.05)


def test_scale_remove_and_close_by_recorded_pids(tmp_path):
    launcher = LocalLauncher(sleeper, tmp_path, stop_grace_s=2.0)
    try:
        launcher.scale(3)
        engines = launcher.engines()
        assert [e.name for e in engines] == ["engine-0", "engine-1", "engine-2"] and all(e.alive for e in engines)
        assert len({e.url for e in engines}) == 3 and all(e.url.startswith("http://127.0.0.1:") for e in engines)
        pids = {e.name: e.pid for e in engines}
        for i in range(3):  # each runs the command the launcher built for it (once exec'd)
            deadline = time.monotonic() + 10
            while f"engine {i} on port" not in " ".join(procs.cmdline_of(pids[f"engine-{i}"])):
                assert time.monotonic() < deadline, procs.cmdline_of(pids[f"engine-{i}"])
                time.sleep(0.01)
        launcher.scale(3, remove=["engine-0"])  # replaced by a new one
        assert [e.name for e in launcher.engines()] == ["engine-1", "engine-2", "engine-3"]
        pids["engine-3"] = launcher.engines()[-1].pid
        launcher.scale(1)  # the newest go first
        assert [e.name for e in launcher.engines()] == ["engine-1"]
        for name in ("engine-0", "engine-2", "engine-3"):  # engine-3 stopped right after its start
            wait_gone(pids[name])
        launcher.processes["engine-1"][0].signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while launcher.engines()[0].alive:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        launcher.close()
    assert launcher.engines() == [] and not procs.cmdline_of(pids["engine-1"])
