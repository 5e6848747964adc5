"""LocalLauncher with real (stand-in) processes: starts to a count, stops the named ones and the newest by the PIDs it
recorded, reports exited ones as not alive, and stops everything on close; a new launcher in the same work dir stops
the engines a SIGKILLed one left running (engines.json), never a process that merely has a recorded PID, and waits
for each it signalled by PID and start time, whatever its command line becomes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common import procs
from services.common.errors import FailedPrecondition
from services.rollout.pool.launchers import RECORD_FILE, LocalLauncher

REPO = Path(__file__).resolve().parents[2]


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


# A manager stand-in in its own process: a LocalLauncher with two engines; engine 1 ignores SIGTERM (SIGKILL needed).
MANAGER = """
import sys, time
from pathlib import Path
from services.rollout.pool.launchers import LocalLauncher

def argv(port, index):
    ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if index == 1 else ""
    return [sys.executable, "-c", ignore + f"import time; time.sleep(60)  # engine {index} on port {port}"]

LocalLauncher(argv, Path(sys.argv[1])).scale(2)
time.sleep(60)
"""


def recorded(work_dir: Path) -> dict:
    return json.loads((work_dir / RECORD_FILE).read_text())


def sigterm_in(pid: int, field: str) -> bool:
    """Whether SIGTERM is in a signal set of /proc/PID/status: "SigIgn" (ignored) or "SigCgt" (caught by a handler)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1], 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def kill_if_same(pid: int, start_time: int | None) -> None:
    """Clean-up after a failure: SIGKILL `pid` only while it is still the process that started at start_time."""
    if start_time is not None and procs.start_time(pid) == start_time:
        os.kill(pid, signal.SIGKILL)


def test_a_new_launcher_stops_what_a_killed_one_left_and_only_that(tmp_path):
    manager = subprocess.Popen([sys.executable, "-c", MANAGER, str(tmp_path)], cwd=REPO, start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # holds a recorded PID
    engines: list[dict] = []
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / RECORD_FILE).is_file() or len(engines := recorded(tmp_path)["engines"]) < 2:
            assert manager.poll() is None and time.monotonic() < deadline, "the manager stand-in did not start 2"
            time.sleep(0.05)
        while not sigterm_in(engines[1]["pid"], "SigIgn"):  # else SIGTERM could still end it
            assert time.monotonic() < deadline, "engine 1 does not ignore SIGTERM"
            time.sleep(0.05)
        # A second manager while the first runs would stop its engines: refused, nothing signalled.
        with pytest.raises(FailedPrecondition, match=f"belongs to process {manager.pid}, which still runs"):
            LocalLauncher(sleeper, tmp_path).stop_leftovers()
        manager.send_signal(signal.SIGKILL)
        manager.wait(10)
        assert all(procs.start_time(e["pid"]) == e["start_time"] for e in engines), "engines died with the manager"

        # Entries naming the bystander's PID: one with another start time (a reused PID), one with its start time
        # but another command line. Neither is the recorded process: it must survive.
        started = procs.start_time(bystander.pid)
        impostors = [{"name": "engine-7", "pid": bystander.pid, "start_time": started + 1, "argv": bystander.args,
                      "url": "http://127.0.0.1:7"},
                     {"name": "engine-8", "pid": bystander.pid, "start_time": started, "argv": ["an-engine"],
                      "url": "http://127.0.0.1:8"}]
        record = recorded(tmp_path)
        (tmp_path / RECORD_FILE).write_text(json.dumps({**record, "engines": record["engines"] + impostors}))

        launcher = LocalLauncher(sleeper, tmp_path, stop_grace_s=1.0)
        began = time.monotonic()
        leftovers = launcher.stop_leftovers()
        assert 1.0 <= time.monotonic() - began < 8.0  # engine 1 ignored SIGTERM: SIGKILL after the 1 s grace
        assert [(e.name, e.url, e.pid, e.alive) for e in leftovers] == \
               [(e["name"], e["url"], e["pid"], False) for e in engines + impostors]
        assert all(procs.start_time(e["pid"]) != e["start_time"] for e in engines), "a leftover still runs"
        assert bystander.poll() is None and procs.start_time(bystander.pid) == started
        assert recorded(tmp_path) == {"owner": {"pid": os.getpid(), "start_time": procs.start_time(os.getpid())},
                                      "engines": []}

        # From now on the record follows this launcher's own engines.
        try:
            launcher.scale(1)
            (name, (proc, url)), = launcher.processes.items()
            assert recorded(tmp_path)["engines"] == [{"name": name, "pid": proc.pid, "argv": proc.argv, "url": url,
                                                      "start_time": procs.start_time(proc.pid)}]
        finally:
            launcher.close()
        assert recorded(tmp_path)["engines"] == []
        assert LocalLauncher(sleeper, tmp_path).stop_leftovers() == []
    finally:
        if manager.poll() is None:
            manager.kill()
            manager.wait(10)
        for e in engines:
            kill_if_same(e["pid"], e["start_time"])
        bystander.kill()
        bystander.wait(10)


# An engine that, on SIGTERM, execs into another command line that ignores SIGTERM: the same process (PID and start
# time) under a new name, as an exiting process is once it has lost its command line.
RENAMED_ON_SIGTERM = """
import os, signal, sys, time
after = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)  # renamed"
signal.signal(signal.SIGTERM, lambda *_: os.execv(sys.executable, [sys.executable, "-c", after]))
time.sleep(60)
"""


def test_a_leftover_is_waited_for_by_pid_and_start_time_once_signalled(tmp_path):
    """Its command line, checked before the first signal, no longer names it after: the launcher still waits for
    the process itself to go, with SIGKILL after the grace."""
    engine = subprocess.Popen([sys.executable, "-c", RENAMED_ON_SIGTERM], start_new_session=True)
    started = procs.start_time(engine.pid)
    try:
        deadline = time.monotonic() + 30
        while not sigterm_in(engine.pid, "SigCgt"):
            assert engine.poll() is None and time.monotonic() < deadline, "the engine did not set its handler"
            time.sleep(0.05)
        entry = {"name": "engine-0", "pid": engine.pid, "start_time": started, "argv": engine.args,
                 "url": "http://127.0.0.1:1"}
        tmp_path.joinpath(RECORD_FILE).write_text(json.dumps({"owner": {}, "engines": [entry]}))
        assert [e.name for e in LocalLauncher(sleeper, tmp_path, stop_grace_s=1.0).stop_leftovers()] == ["engine-0"]
        assert engine.wait(10) == -signal.SIGKILL  # renamed, it ignored SIGTERM: stopped, not taken for gone
    finally:
        kill_if_same(engine.pid, started)
        engine.wait(10)


def test_stack_down_stops_engines_a_killed_manager_left(tmp_path):
    """`physarum down` after the manager was SIGKILLed: the engines it recorded still run, and down stops them."""
    from physarum import stack

    engine = subprocess.Popen(sleeper(0, 0), start_new_session=True)
    try:
        entry = {"name": "engine-0", "pid": engine.pid, "start_time": procs.start_time(engine.pid),
                 "argv": engine.args, "url": "http://127.0.0.1:1"}
        (tmp_path / "engines").mkdir()
        (tmp_path / "engines" / RECORD_FILE).write_text(json.dumps({"owner": {"pid": 1, "start_time": 0},
                                                                     "engines": [entry]}))
        (tmp_path / stack.STATE_FILE).write_text(json.dumps({"processes": []}))
        assert stack.down(tmp_path, grace_s=5.0) == ["engine-0"]
        assert engine.wait(10) == -signal.SIGTERM
    finally:
        kill_if_same(engine.pid, entry["start_time"])
        engine.wait(10)
