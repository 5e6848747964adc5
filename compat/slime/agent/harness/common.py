"""slime.agent.harness.common: the harness lifecycle (BaseHarness.run: the agent user, the CLI's config, the launch
to completion within a time budget), HarnessContext, run_agent and install_npm_cli, as slime defines them.

Differences from slime, by design: a harness's paths come from the sandbox (a LocalSandbox's own home and bin
directory; /home/agent and /usr/local/bin elsewhere), and install_cli takes the CLI that `make agent-clis` installed
into the repository (.agent-clis/, or $PHYSARUM_AGENT_CLIS) unless slime's tarball variable names an npm package.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from abc import ABC, ABCMeta, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from slime.agent import sandbox as _sandbox
from slime.agent.sandbox import LocalSandbox, Sandbox, exec_and_wait
from slime.utils.misc import SingletonMeta

NPM_INSTALL_RETRIES = 3
NPM_INSTALL_BACKOFF_SEC = 2.0
AGENT_CLIS_ENV = "PHYSARUM_AGENT_CLIS"
REPO_ROOT = Path(__file__).resolve().parents[4]


class SingletonABCMeta(ABCMeta, SingletonMeta):
    pass


@dataclass(frozen=True)
class HarnessContext:
    """A run's generic fields; `model_label` is the model name the CLI is told (the gateway serves the job's)."""

    workdir: str
    session_id: str
    adapter_url: str
    model_label: str = "slime-actor"


def agent_home(sb: Sandbox) -> str:
    return _sandbox.home_of(sb, "agent")


def bin_dir(sb: Sandbox) -> str:
    return str(sb.bin_dir) if isinstance(sb, LocalSandbox) else "/usr/local/bin"


def root_url(adapter_url: str) -> str:
    """The gateway's root: slime passes the adapter's root, Physarum's OpenAI adapter.url ends in /v1."""
    return adapter_url.rstrip("/").removesuffix("/v1")


def agent_clis_dir() -> Path:
    """Where `make agent-clis` installs the CLIs (an npm project: node_modules/.bin/<cli>)."""
    return Path(os.environ.get(AGENT_CLIS_ENV) or REPO_ROOT / ".agent-clis")


def installed_cli(executable: str) -> Path:
    path = agent_clis_dir() / "node_modules" / ".bin" / executable
    if not path.exists():
        raise FileNotFoundError(f"agent CLI {executable!r} is not installed at {path}: run `make agent-clis` (needs "
                                f"npm), or set ${AGENT_CLIS_ENV} to an npm directory that has it")
    return path


class BaseHarness(ABC, metaclass=SingletonABCMeta):
    """A sandbox-resident coding agent: install_cli, write_config, launch_and_wait; run() makes the agent user, then
    writes the config and launches."""

    name: str = ""
    executable: str = ""

    node_tarball_env: str = ""
    cli_tarball_env: str = ""

    async def install_cli(self, sb: Sandbox) -> None:
        """Put the harness CLI on the sandbox's PATH: from the npm tarball $cli_tarball_env names (slime's way), else
        the repository's installed CLI."""
        if os.environ.get(self.cli_tarball_env):
            node = os.environ.get(self.node_tarball_env)
            await install_npm_cli(sb, node_runtime=Path(node) if node else None,
                                  npm_package=Path(os.environ[self.cli_tarball_env]),
                                  check_cmd=f"{bin_dir(sb)}/{self.executable} --version")
        else:
            await self.install_local_cli(sb)

    @abstractmethod
    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Write the CLI's config files into the sandbox."""

    @abstractmethod
    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int) -> int:
        """Run the agent to completion; its exit code (EXIT_TIME_BUDGET_EXCEEDED past the budget)."""

    async def run(self, sb: Sandbox, *, workdir: str, session_id: str, adapter_url: str, time_budget_sec: int,
                  prompt: str) -> int:
        """The agent user, the config, the launch: the CLI's exit code. Workspace preparation is the caller's."""
        await _sandbox.ensure_agent_user(sb, workdir)
        ctx = HarnessContext(workdir=workdir, session_id=session_id, adapter_url=adapter_url)
        await self.write_config(sb, ctx)
        return await self.launch_and_wait(sb, ctx, prompt, time_budget_sec)

    async def install_local_cli(self, sb: Sandbox) -> None:
        """The repository's installed CLI linked into the sandbox's bin directory."""
        target = installed_cli(self.executable)
        await sb.exec(f"mkdir -p {bin_dir(sb)} && ln -sf {shlex.quote(str(target))} {bin_dir(sb)}/{self.executable}"
                      f" && {bin_dir(sb)}/{self.executable} --version", check=True, timeout=120)


async def run_agent(sb: Sandbox, *, workdir: str, start_cmd: str, env: dict[str, str], time_budget_sec: int) -> int:
    """Launch the agent (start_cmd) as the agent user in `workdir` and run it to completion: its exit code."""
    meta_dir = f"{workdir}/.harness"
    await sb.exec(f"mkdir -p {shlex.quote(meta_dir)}", user="root", check=True, timeout=30)
    exit_code, _ = await exec_and_wait(sb, cmd=start_cmd, user="agent", env=env, workdir=workdir,
                                       out_file=f"{meta_dir}/trajectory.jsonl", time_budget_sec=time_budget_sec,
                                       tag="run")
    return exit_code


async def install_npm_cli(sb: Sandbox, *, node_runtime: Path | None, npm_package: Path, check_cmd: str) -> None:
    """An npm-packaged CLI installed globally into the sandbox (its bin directory's prefix), then `check_cmd`; the
    Node runtime is the sandbox's own (`node_runtime` is accepted for slime's signature, not unpacked)."""
    prefix = str(Path(bin_dir(sb)).parent)
    package = f"{_sandbox._scratch(sb)}/harness-cli.tgz"
    await sb.write_file(package, Path(npm_package))
    install = f"npm install -g --prefix={shlex.quote(prefix)} --no-audit --no-fund {package} && {check_cmd}"
    log = ""
    for attempt in range(NPM_INSTALL_RETRIES):
        code, log = await exec_and_wait(sb, cmd=install, user="root", time_budget_sec=300, tag="harness-npm-install")
        if code == 0:
            return
        await asyncio.sleep(NPM_INSTALL_BACKOFF_SEC * (attempt + 1))
    raise RuntimeError(f"npm install failed after {NPM_INSTALL_RETRIES} attempts (exit={code}):\n{log[-1000:]}")


__all__ = ["BaseHarness", "HarnessContext", "SingletonABCMeta", "agent_clis_dir", "install_npm_cli", "installed_cli",
           "run_agent"]
