"""slime.agent.harness: swappable coding-agent harnesses (Claude Code, Codex) that run a real agent CLI in a sandbox
pointed at the rollout service's agent gateway."""

from __future__ import annotations

from slime.agent.harness.claude_code import ClaudeCodeHarness
from slime.agent.harness.codex import CodexHarness
from slime.agent.harness.common import BaseHarness, HarnessContext

__all__ = ["BaseHarness", "ClaudeCodeHarness", "CodexHarness", "HarnessContext"]
