"""slime.agent.sandbox: slime's Sandbox contract (exec, write_file, read_file as an async context manager),
exec_and_wait (a detached command polled to its exit code within a time budget) and ensure_agent_user, with
Physarum's LocalSandbox: a private directory on this machine whose commands run as local processes.

Differences from slime, by design: E2BSandbox (a remote sandbox cluster) is not provided; LocalSandbox is no
isolation boundary (its commands run as this user, on this machine's filesystem and network) but it gives each run
its own HOME and a scrubbed environment, and a command past its time budget is stopped with its process group (slime
leaves it to the sandbox's teardown).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

ExecResult = tuple[int, str, str]
FileContent = str | bytes | Path

EXIT_TIME_BUDGET_EXCEEDED = -1
POLL_INTERVAL_S = 1.0


@runtime_checkable
class Sandbox(Protocol):
    """slime's minimal async sandbox interface."""

    sandbox_id: str

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, exc_type, exc, tb) -> None: ...

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> ExecResult: ...

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None: ...

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str: ...


def home_of(sb: Sandbox, user: str) -> str:
    """A user's home in the sandbox: /home/<user> (/root for root), or the LocalSandbox's own."""
    if isinstance(sb, LocalSandbox):
        return str(sb.agent_home)
    return "/root" if user == "root" else f"/home/{user}"


class LocalSandbox:
    """A sandbox on this machine: a fresh directory (`root`) holding the agent's home (`agent_home`), a `bin_dir`
    first on PATH and a `workdir`; commands run with bash in their own process group, with HOME, PATH, a UTF-8
    locale and only the variables they are given (nothing of this process's environment, no proxies or keys).
    Users are accepted and not switched: every command runs as this process's user."""

    def __init__(self, root: str | Path | None = None, *, keep: bool = False) -> None:
        self._made_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="physarum-sandbox-"))
        self.keep = keep
        self.agent_home = self.root / "home" / "agent"
        self.bin_dir = self.root / "bin"
        self.workdir = self.root / "workspace"
        self.sandbox_id = f"local-{self.root.name}"
        self._groups: set[int] = set()

    async def __aenter__(self) -> LocalSandbox:
        for path in (self.agent_home, self.bin_dir, self.workdir):
            path.mkdir(parents=True, exist_ok=True)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        for group in list(self._groups):
            kill_group(group)
        self._groups.clear()
        if self._made_root and not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def environment(self, env: dict[str, str] | None) -> dict[str, str]:
        base = {"HOME": str(self.agent_home), "PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "LANG": "C.UTF-8", "TERM": "dumb",
                # Claude Code refuses to bypass permissions as root unless it is told it runs in a sandbox
                "IS_SANDBOX": "1"}
        return {**base, **(env or {})}

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True) -> ExecResult:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", cmd, cwd=self.root, env=self.environment(env), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        self._groups.add(proc.pid)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            kill_group(proc.pid)
            await proc.wait()
            raise TimeoutError(f"sandbox exec timed out after {timeout}s: {cmd[:120]}") from None
        finally:
            self._groups.discard(proc.pid)
        code = proc.returncode if proc.returncode is not None else -1
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        if check and code != 0:
            raise RuntimeError(f"sandbox exec failed (exit={code}): {cmd[:120]}\n{stderr[:400]}")
        return code, stdout, stderr

    def track(self, group: int) -> None:
        """A detached process group the sandbox stops when it closes."""
        self._groups.add(group)

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        path = Path(sandbox_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copyfile(content, path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        try:
            return Path(sandbox_path).read_text(errors="replace")
        except OSError:
            return ""


def kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _scratch(sb: Sandbox) -> str:
    return str(sb.root / "tmp") if isinstance(sb, LocalSandbox) else "/tmp"


async def _await_done_marker(sb: Sandbox, done_file: str, *, user: str, time_budget_sec: int) -> int:
    """The detached command's exit code from its marker file, or EXIT_TIME_BUDGET_EXCEEDED past the budget."""
    deadline = time.monotonic() + time_budget_sec
    while time.monotonic() < deadline:
        await asyncio.sleep(POLL_INTERVAL_S)
        code, out, _ = await sb.exec(f"test -f {done_file} && cat {done_file}", user=user, timeout=15)
        if code == 0 and out.strip():
            return int(out.strip())
    return EXIT_TIME_BUDGET_EXCEEDED


async def exec_and_wait(sb: Sandbox, *, cmd: str, time_budget_sec: int, tag: str, user: str = "root",
                        env: dict[str, str] | None = None, workdir: str | None = None, out_file: str | None = None,
                        want_output: bool = False) -> tuple[int, str]:
    """Run `cmd` detached (setsid, output to `out_file`, its exit code to a marker file) and poll the marker, as
    slime does; returns (exit code, the output when wanted, else the tail of a failed command's output). Past
    `time_budget_sec` the command's process group is stopped and the code is EXIT_TIME_BUDGET_EXCEEDED."""
    scratch = _scratch(sb)
    out_file = out_file or f"{scratch}/.{tag}.out"
    done_file, pid_file, launcher = (f"{scratch}/.{tag}.{kind}" for kind in ("done", "pid", "sh"))
    prefix = f"cd {shlex.quote(workdir)}\nexport HOME={shlex.quote(home_of(sb, user))}\n" if workdir else ""
    await sb.write_file(launcher, f"#!/bin/bash\necho $$ > {pid_file}\n{prefix}{cmd}\necho $? > {done_file}\n",
                        user=user)
    await sb.exec(f"mkdir -p {scratch}; rm -f {out_file} {done_file} {pid_file}", user=user, timeout=30, check=True)
    await sb.exec(f"chmod +x {launcher}; setsid bash {launcher} < /dev/null > {out_file} 2>&1 &", user=user, env=env,
                  timeout=30, check=True)
    group = None
    for _ in range(50):  # the launcher writes its pid (its process group: setsid made it the leader) at once
        code, out, _ = await sb.exec(f"cat {pid_file} 2>/dev/null", user=user, timeout=15)
        if out.strip().isdigit():
            group = int(out.strip())
            break
        await asyncio.sleep(0.1)
    if group is not None and isinstance(sb, LocalSandbox):
        sb.track(group)
    exit_code = await _await_done_marker(sb, done_file, user=user, time_budget_sec=time_budget_sec)
    if exit_code == EXIT_TIME_BUDGET_EXCEEDED and group is not None:
        await sb.exec(f"kill -KILL -- -{group} 2>/dev/null", user=user, timeout=15)
    if exit_code == 0 and not want_output:
        return exit_code, ""
    if want_output:
        return exit_code, await sb.read_file(out_file, user=user)
    _, tail, _ = await sb.exec(f"tail -c 512 {out_file} 2>/dev/null", user=user, timeout=15)
    return exit_code, tail


async def ensure_agent_user(sb: Sandbox, workdir: str) -> None:
    """The unprivileged 'agent' user that owns `workdir`, as slime makes it; in a LocalSandbox (no user switching)
    the agent's home and `workdir`."""
    if isinstance(sb, LocalSandbox):
        sb.agent_home.mkdir(parents=True, exist_ok=True)
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return
    await sb.exec(f"id agent >/dev/null 2>&1 || useradd -m -s /bin/bash agent && chown -R agent:agent /home/agent "
                  f"{shlex.quote(workdir)} && git config --system --add safe.directory '*' && id agent",
                  user="root", check=True, timeout=60)


class E2BSandbox:
    """slime's E2B sandbox is not provided: Physarum runs harnesses in a LocalSandbox (or a Sandbox of your own)."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("slime.agent.sandbox.E2BSandbox is not provided by Physarum; use "
                                  "slime.agent.sandbox.LocalSandbox, or pass any object with slime's Sandbox methods")


__all__ = ["EXIT_TIME_BUDGET_EXCEEDED", "E2BSandbox", "ExecResult", "FileContent", "LocalSandbox", "Sandbox",
           "ensure_agent_user", "exec_and_wait", "home_of"]
