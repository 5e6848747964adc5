"""The gateway's Anthropic request fields: what Claude Code sends is accepted, what the gateway cannot honour is
refused by name."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.rollout.gateway.anthropic_api import params


def test_claude_codes_effort_is_accepted_and_a_structured_output_format_refused():
    body = {"model": "m", "messages": [], "max_tokens": 7, "stream": True, "output_config": {"effort": "high"},
            "metadata": {"user_id": "u"}}
    assert params(body).max_tokens == 7
    with pytest.raises(InvalidArgument, match="output_config: only 'effort'"):
        params({**body, "output_config": {"format": {"type": "json_schema"}}})
    with pytest.raises(InvalidArgument, match="thinking: extended thinking is not supported"):
        params({**body, "thinking": {"type": "adaptive"}})
