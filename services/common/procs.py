"""Start and stop local processes by the PID recorded at start; find free loopback ports.

Used by the local stack (`physarum up`), the rollout pool's local launcher and the tests. A process is only
ever signalled by the PID this module started, after checking /proc/PID/cmdline still names it.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"


_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=4096)


def free_port(host: str = HOST) -> int:
    """A port that was free a moment ago (the OS picks it), and none this process handed out lately: ports picked
    one after another before anything binds them could otherwise repeat (a buffer and a REST port got the same)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _RECENT_PORTS:
            _RECENT_PORTS.append(port)
            return port


def cmdline_of(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]]  # keeps empty args ("--save", "")


def start_time(pid: int) -> int | None:
    """When the running process PID started (clock ticks since boot, /proc/PID/stat field 22): with the PID, its
    identity, since a reused PID belongs to a process started later. None once it has exited (a zombie included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def terminate(pid: int, still_runs: Callable[[], bool], grace_s: float, kill_wait_s: float = 5.0) -> str | None:
    """Stop a process that is not our child (recorded by an earlier run): SIGTERM while `still_runs()` says it is
    still the recorded process, SIGKILL after grace_s, then wait up to kill_wait_s for it to go. Returns the name of
    the signal that ended it ("SIGTERM", "SIGKILL", or "" if it outlived both), None if it was not running."""
    if not still_runs():
        return None
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return sig.name
        deadline = time.monotonic() + wait_s
        while still_runs() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not still_runs():
            return sig.name
    return ""


_SECRET_ENV = re.compile(r"(^|_)(TOKEN|PASSWORD|SECRET|API_KEY|CREDENTIALS?)$")


def inherited_env() -> dict[str, str]:
    """This process's environment minus variables named like secrets: a child gets a secret only when it is passed
    to it by name (and Physarum's own tokens travel as files, see services.common.auth)."""
    return {k: v for k, v in os.environ.items() if not _SECRET_ENV.search(k.upper())}


@dataclass
class ManagedProcess:
    """A child process with its recorded PID, command line and log file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it open
        env = {**inherited_env(), "PYTHONUNBUFFERED": "1", **self.env}
        self.popen = subprocess.Popen(self.argv, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        log_file.close()
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def owns_pid(self) -> bool:
        """True while the child this object started is alive. An unreaped child keeps its PID, so the PID cannot
        name another process while Popen.poll() is None; the command line is not compared, since some programs
        rewrite it (sglang-router shows "sglang::router")."""
        return self.alive()

    def wait_ready(self, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with code {self.popen.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            if check():
                return
            time.sleep(interval_s)
        raise TimeoutError(f"{self.name} not ready after {timeout_s} s; log {self.log_path}:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        if self.owns_pid():
            os.kill(self.pid, sig)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after grace_s; returns the exit code."""
        if self.popen is None:
            return None
        if self.owns_pid():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                if self.owns_pid():
                    os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=grace_s)
        return self.popen.poll()

    def stop_group(self, grace_s: float = 10.0) -> int | None:
        """End the whole process group the child leads (it was started in a session of its own): SIGTERM to every
        member, SIGKILL after grace_s to any left, waiting until none is; a container runtime's or a launcher's
        children go with it. Returns the leader's exit code."""
        if self.popen is None:
            return None
        pgid = self.popen.pid  # start_new_session: the child leads its group; the id stays in use while any member
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _group_alive(pgid, self.popen) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _group_alive(pgid, self.popen):
            _signal_group(pgid, signal.SIGKILL)
            deadline = time.monotonic() + grace_s
            while _group_alive(pgid, self.popen) and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.popen.poll()

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc."""
    members = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat_file.parent.name))
    return members


def _group_alive(pgid: int, leader: subprocess.Popen) -> bool:
    """Whether a member of the group still runs (the leader reaped first: a zombie leader does not count; nor do
    zombies a parent other than this process has yet to reap)."""
    leader.poll()
    if Path("/proc/self/stat").exists():
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def python_module(module: str, *args: str) -> list[str]:
    """argv that runs `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


APPENDFSYNC = ("always", "everysec", "no")


def start_redis(work_dir: Path, port: int | None = None, appendonly: bool = True,
                appendfsync: str = "everysec") -> tuple[ManagedProcess, str]:
    """A private redis-server in work_dir on a free loopback port (an AOF there is replayed); returns it with its
    URL. appendfsync: everysec may lose the last second of writes to a crash of the machine, always none."""
    if appendfsync not in APPENDFSYNC:
        raise ValueError(f"appendfsync must be one of {', '.join(APPENDFSYNC)}, got {appendfsync!r}")
    port = port or free_port()
    work_dir.mkdir(parents=True, exist_ok=True)
    argv = ["redis-server", "--port", str(port), "--bind", HOST, "--dir", str(work_dir), "--save", "",
            "--appendonly", "yes" if appendonly else "no", "--appendfsync", appendfsync, "--protected-mode", "yes",
            "--set-proc-title", "no"]  # keep argv in /proc/PID/cmdline, so owns_pid() lets stop() signal it
    proc = ManagedProcess("redis", argv, work_dir / "redis.log").start()
    proc.wait_ready(lambda: redis_answers(HOST, port), timeout_s=15)
    return proc, f"redis://{HOST}:{port}/0"


def redis_answers(host: str, port: int) -> bool:
    """Redis at host:port answers PING (not -LOADING, as while it replays its AOF)."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
