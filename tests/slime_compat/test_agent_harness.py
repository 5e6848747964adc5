"""slime.agent.harness and slime.agent.sandbox as slime's coding-agent example calls them: run_agent's detached launch
and time budget on a LocalSandbox (real processes), each harness's config and launch, and one episode of each real
agent CLI (Claude Code, Codex, installed by `make agent-clis`) against the rollout service's agent gateway in a
rollout, with a tiny model whose context holds the CLIs' long first requests."""

from __future__ import annotations

import asyncio
import json
import os
import re
import tomllib
from pathlib import Path

import pytest
from slime.agent import sandbox as sandbox_mod
from slime.agent.harness import ClaudeCodeHarness, CodexHarness, HarnessContext
from slime.agent.harness import common as harness_common
from slime.agent.sandbox import LocalSandbox

from services.common import procs
from services.common.grpc_client import wait_for_health
from services.common.samples import Status
from services.common.settings.rollout import RolloutConfig
from testkit.engines import start_engines, stop_engines
from tests.integration.gateway_fixtures import QUESTION
from tests.slime_compat.cli_model import COMMAND_OUTPUT, REPLY, TOOL_CALLS, build_cli_model


def _run(coro):
    return asyncio.run(coro)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_run_agent_returns_the_commands_exit_code_and_keeps_its_output_in_the_workdir():
    async def case():
        async with LocalSandbox() as sb:
            cmd = 'echo "home=$HOME key=$KEY pwd=$(pwd)"; bash -c "exit 7"'
            code = await harness_common.run_agent(sb, workdir=str(sb.workdir), start_cmd=cmd, env={"KEY": "k1"},
                                                  time_budget_sec=60)
            return code, (sb.workdir / ".harness" / "trajectory.jsonl").read_text(), sb
    code, output, sb = _run(case())
    assert code == 7
    assert output.strip() == f"home={sb.agent_home} key=k1 pwd={sb.workdir}"
    assert not sb.root.exists()  # the sandbox's directory goes with it


def test_a_command_past_its_time_budget_is_stopped_with_its_children():
    async def case():
        async with LocalSandbox() as sb:
            code = await harness_common.run_agent(sb, workdir=str(sb.workdir), start_cmd="sleep 300 & echo $! > "
                                                  f"{sb.root}/child; wait", env={}, time_budget_sec=2)
            child = int((sb.root / "child").read_text())
            await asyncio.sleep(0.5)
            return code, child
    code, child = _run(case())
    assert code == sandbox_mod.EXIT_TIME_BUDGET_EXCEEDED
    assert not _alive(child)


def test_the_local_sandbox_environment_is_its_own():
    os.environ["PHYSARUM_TEST_SECRET"] = "leak"
    try:
        async def case():
            async with LocalSandbox() as sb:
                return await sb.exec("echo ${PHYSARUM_TEST_SECRET:-none} $HOME; exit 3"), sb
        (code, out, _), sb = _run(case())
    finally:
        del os.environ["PHYSARUM_TEST_SECRET"]
    assert (code, out.split()) == (3, ["none", str(sb.agent_home)])
    with pytest.raises(RuntimeError, match=r"sandbox exec failed \(exit=3\)"):
        _run(_checked_failure())


async def _checked_failure():
    async with LocalSandbox() as sb:
        await sb.exec("exit 3", check=True)


def _fake_cli(sb: LocalSandbox, name: str) -> None:
    """A stand-in CLI recording its arguments and environment (the harness's wiring, not the CLI, is tested)."""
    path = sb.bin_dir / name
    path.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {sb.root}/args\nenv > {sb.root}/env\n')
    path.chmod(0o755)


def _recorded(sb: LocalSandbox) -> tuple[list[str], dict[str, str]]:
    env = dict(line.split("=", 1) for line in (sb.root / "env").read_text().splitlines() if "=" in line)
    return (sb.root / "args").read_text().splitlines(), env


def test_claude_code_harness_config_launch_and_env():
    async def case():
        async with LocalSandbox() as sb:
            _fake_cli(sb, "claude")
            code = await ClaudeCodeHarness().run(sb, workdir=str(sb.workdir), session_id="sess-cc",
                                                 adapter_url="http://gw:1", time_budget_sec=60, prompt="solve it")
            settings = json.loads((sb.agent_home / ".claude" / "settings.json").read_text())
            return code, settings, json.loads((sb.agent_home / ".claude.json").read_text()), *_recorded(sb)
    code, settings, onboarding, args, env = _run(case())
    assert code == 0 and settings == onboarding == {"hasCompletedOnboarding": True,
                                                    "bypassPermissionsModeAccepted": True}
    assert args[:4] == ["-p", "solve it", "--permission-mode", "bypassPermissions"]
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_AUTH_TOKEN"], env["ANTHROPIC_MODEL"]) == \
        ("http://gw:1", "sess-cc", "slime-actor")
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == env["DISABLE_AUTOUPDATER"] == "1"
    assert ClaudeCodeHarness() is ClaudeCodeHarness()  # one instance per class, as slime's harnesses


def test_codex_harness_config_launch_and_env():
    async def case(url):
        async with LocalSandbox() as sb:
            _fake_cli(sb, "codex")
            ctx = HarnessContext(workdir=str(sb.workdir), session_id="sess-cx", adapter_url=url)
            await sandbox_mod.ensure_agent_user(sb, ctx.workdir)
            await CodexHarness().write_config(sb, ctx)
            code = await CodexHarness().launch_and_wait(sb, ctx, "fix the bug", 60)
            config = tomllib.loads((sb.agent_home / ".codex" / "config.toml").read_text())
            return code, config, *_recorded(sb)
    for url in ("http://gw:2", "http://gw:2/v1"):  # slime's adapter root, or Physarum's OpenAI adapter.url
        code, config, args, env = _run(case(url))
        assert code == 0 and args == ["exec", "--skip-git-repo-check", "fix the bug"]
        provider = config["model_providers"][config["model_provider"]]
        assert (provider["base_url"], provider["wire_api"], provider["env_key"]) == \
            ("http://gw:2/v1", "responses", "OPENAI_API_KEY")
        assert config["web_search"] == "disabled" and config["analytics"] == {"enabled": False}
        assert (env["OPENAI_API_KEY"], env["OPENAI_BASE_URL"]) == ("sess-cx", "http://gw:2/v1")


def test_a_missing_cli_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv(harness_common.AGENT_CLIS_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="run `make agent-clis`"):
        _run(_install_codex())


async def _install_codex():
    async with LocalSandbox() as sb:
        await CodexHarness().install_cli(sb)


def _clis_installed() -> str | None:
    missing = [cli for cli in ("claude", "codex")
               if not (harness_common.agent_clis_dir() / "node_modules" / ".bin" / cli).exists()]
    return f"agent CLIs {missing} not installed: `make agent-clis` installs them (needs npm)" if missing else None


@pytest.fixture(scope="module")
def cli_stack(redis_url, shared_router, session_dir):
    if reason := _clis_installed():
        pytest.skip(reason)
    model_dir = build_cli_model(session_dir / "cli-model")
    work = session_dir / "agent-harness"
    work.mkdir(exist_ok=True)
    ports = {name: procs.free_port() for name in ("buffer", "reward")}
    started = []
    engines = start_engines(model_dir, work, 1)
    try:
        for name, args in (("buffer", ["--redis-url", redis_url]), ("reward", ["--rest-port", str(procs.free_port())])):
            argv = procs.python_module(f"services.{name}", "--host", procs.HOST, "--port", str(ports[name]), *args)
            started.append(procs.ManagedProcess(name, argv, work / f"{name}.log").start())
        shared_router.add_worker(engines[0][1], timeout_s=30)
        for name in ("buffer", "reward"):
            wait_for_health(f"{procs.HOST}:{ports[name]}", timeout_s=60)
        yield {"buffer_addr": f"{procs.HOST}:{ports['buffer']}", "reward_addr": f"{procs.HOST}:{ports['reward']}",
               "router": shared_router.url, "model": model_dir, "work": work}
    finally:
        for proc in reversed(started):
            proc.stop()
        stop_engines(engines)


@pytest.mark.slow  # its own engine and services, and each CLI's two requests of ~10-25k tokens: about 2 minutes
@pytest.mark.parametrize("harness", ["claude_code", "codex"])  # Anthropic Messages; OpenAI Responses
def test_one_episode_of_the_real_agent_cli_on_the_gateway(cli_stack, harness):
    from tests.integration.test_agent_rollout import run_rollouts

    cfg = RolloutConfig(job_id=f"slime-harness-{harness.replace('_', '-')}", rollout_batch_size=1,
                        n_samples_per_prompt=1, rollout_temperature=0.0, rollout_max_response_len=1024,
                        apply_chat_template=True, rm_type="exact_match", lease_timeout_s=300.0,
                        custom_generate_function_path=f"tests.slime_compat.plugins.{harness}_generate")
    (groups,) = run_rollouts(cli_stack, cfg, [0])
    (sample,) = groups[0].samples
    transcript = sample.metadata["transcript_tail"]
    assert sample.metadata["agent_exit_code"] == 0, transcript
    assert sample.status == Status.COMPLETED and sample.reward == 1.0  # the harness's reward, kept
    assert sample.metadata["harness"] == harness, transcript
    # two turns: the model's shell command, run by the CLI in the sandbox (its output came back as the tool's
    # result), then the answer the CLI printed
    assert sample.metadata["agent_turns"] == 2 and sample.metadata["agent_final_content"] == REPLY, transcript
    assert REPLY in transcript
    # the CLI's own system prompt and tools (thousands of tokens) and the task are the prompt
    assert len(sample.tokens) - sample.response_length > 5000
    assert {"claude_code": "Claude", "codex": "Codex CLI"}[harness] in sample.prompt and QUESTION in sample.prompt
    # the response: the call (trained), the tool's result with the template around it (not trained), the answer
    assert sample.response.startswith(TOOL_CALLS) and sample.response.endswith(REPLY)
    tool_result = sample.response[len(TOOL_CALLS):-len(REPLY)]  # Codex reports its command's exit code and output
    assert re.search(rf"<tool_response>\n(.*\n)?(Output:\n)?{COMMAND_OUTPUT}\n+</tool_response>", tool_result, re.S)
    mask = sample.loss_mask
    assert mask[0] == mask[-1] == 1 and 0 in mask and len(mask) == sample.response_length
