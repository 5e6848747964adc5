"""slime.agent.harness.codex: CodexHarness, `codex exec` with a model provider whose base URL is the gateway's /v1
and whose key is the session id.

Differences from slime: the provider speaks the Responses API (`wire_api = "responses"`: Codex no longer accepts
"chat"), and the config turns off what would leave the gateway or needs a hosted tool: web search, sub-agents,
goals, apps, analytics and the update check.
"""

from __future__ import annotations

import base64
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


def v1_url(adapter_url: str) -> str:
    return f"{root_url(adapter_url)}/v1"


class CodexHarness(BaseHarness):
    name = "codex"
    executable = "codex"

    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"
    cli_tarball_env = "SLIME_AGENT_CODEX_TARBALL"
    extra_args_env = "SLIME_AGENT_CODEX_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CODEX_EXTRA_ENVS"

    exec_flags = "--skip-git-repo-check"

    # base_url inline: Codex reads its environment only for the default OpenAI provider
    config_toml = (
        'model = "{model}"\n'
        'model_provider = "slime"\n'
        'web_search = "disabled"\n'
        "check_for_update_on_startup = false\n"
        "\n"
        "[model_providers.slime]\n"
        'name = "slime"\n'
        'base_url = "{base_url}"\n'
        'env_key = "OPENAI_API_KEY"\n'
        'wire_api = "responses"\n'
        "\n"
        "[features]\n"
        "goals = false\n"
        "apps = false\n"
        "\n"
        "[agents]\n"
        "enabled = false\n"
        "\n"
        "[analytics]\n"
        "enabled = false\n"
    )

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        toml = self.config_toml.format(model=ctx.model_label, base_url=v1_url(ctx.adapter_url))
        encoded = base64.b64encode(toml.encode()).decode("ascii")
        home = agent_home(sb)
        await sb.exec(f"mkdir -p {home}/.codex && echo {shlex.quote(encoded)} | base64 -d > {home}/.codex/config.toml",
                      user="root", check=True, timeout=60)

    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int) -> int:
        cmd = f"{bin_dir(sb)}/codex exec {self.exec_flags} {shlex.quote(prompt)}"
        extra = os.environ.get(self.extra_args_env, "").strip()
        if extra:
            cmd = f"{cmd} {extra}"
        env = {"OPENAI_API_KEY": ctx.session_id, "OPENAI_BASE_URL": v1_url(ctx.adapter_url)}
        extra_envs = os.environ.get(self.extra_envs_env, "").strip()
        if extra_envs:
            env.update(json.loads(extra_envs))
        return await run_agent(sb, workdir=ctx.workdir, start_cmd=cmd, env=env, time_budget_sec=time_budget_sec)


__all__ = ["CodexHarness"]
