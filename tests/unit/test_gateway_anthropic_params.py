"""The gateway's Anthropic request fields: what Claude Code sends is accepted, what the gateway cannot honour is
refused by name."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.rollout.gateway.anthropic_api import params
from services.rollout.gateway.conversation import Limits, from_anthropic


def test_claude_codes_effort_is_accepted_and_a_structured_output_format_refused():
    body = {"model": "m", "messages": [], "max_tokens": 7, "stream": True, "output_config": {"effort": "high"},
            "metadata": {"user_id": "u"}}
    assert params(body).max_tokens == 7
    with pytest.raises(InvalidArgument, match="output_config: only 'effort'"):
        params({**body, "output_config": {"format": {"type": "json_schema"}}})
    # Claude Code asks for adaptive thinking: served as a model without extended thinking is (no thinking blocks)
    for kind in ("adaptive", "enabled", "disabled"):
        assert params({**body, "thinking": {"type": kind}}).max_tokens == 7
    with pytest.raises(InvalidArgument, match="thinking.type: one of adaptive, disabled, enabled"):
        params({**body, "thinking": {"type": "deep"}})


def test_a_system_message_among_the_messages_is_kept_in_place():
    body = {"system": "s", "messages": [{"role": "user", "content": "hi"},
                                        {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}]}
    assert from_anthropic(body, Limits()).messages == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
        {"role": "system", "content": "# Environment"}]
    bad = {"messages": [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "5"}]}]}
    with pytest.raises(InvalidArgument, match=r"messages\[0\].content\[0\]: a system message holds text blocks only"):
        from_anthropic(bad, Limits())
