"""slime.agent.harness.claude_code: ClaudeCodeHarness, `claude -p` headless with bypassed permissions, its
Anthropic base URL the gateway's and its API key the session id; its telemetry, error reports and auto-update off."""

from __future__ import annotations

import json
import os
import shlex

from slime.agent.harness.common import (
    BaseHarness,
    HarnessContext,
    agent_home,
    bin_dir,
    root_url,
    run_agent,
)
from slime.agent.sandbox import Sandbox


class ClaudeCodeHarness(BaseHarness):
    name = "claude_code"
    executable = "claude"

    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"
    cli_tarball_env = "SLIME_AGENT_CC_TARBALL"
    extra_args_env = "SLIME_AGENT_CC_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CC_EXTRA_ENVS"

    launch_flags = ("--permission-mode bypassPermissions --output-format stream-json --include-partial-messages "
                    "--include-hook-events --verbose")

    static_env = {
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, error reports, auto-update
        "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Onboarding done and bypass-permissions acknowledged, so Claude Code starts headless."""
        home = agent_home(sb)
        settings = json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True})
        await sb.exec(f"mkdir -p {home}/.claude && echo {shlex.quote(settings)} | tee {home}/.claude.json "
                      f"{home}/.claude/settings.json > /dev/null", user="root", check=True, timeout=60)

    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int) -> int:
        cmd = f"{bin_dir(sb)}/claude -p {shlex.quote(prompt)} {self.launch_flags}"
        extra = os.environ.get(self.extra_args_env, "").strip()
        if extra:
            cmd = f"{cmd} {extra}"
        env = {"ANTHROPIC_BASE_URL": root_url(ctx.adapter_url), "ANTHROPIC_AUTH_TOKEN": ctx.session_id,
               "ANTHROPIC_MODEL": ctx.model_label, **self.static_env}
        extra_envs = os.environ.get(self.extra_envs_env, "").strip()
        if extra_envs:
            env.update(json.loads(extra_envs))
        return await run_agent(sb, workdir=ctx.workdir, start_cmd=cmd, env=env, time_budget_sec=time_budget_sec)


__all__ = ["ClaudeCodeHarness"]
