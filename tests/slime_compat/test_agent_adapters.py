"""slime.agent.adapters.openai on the rollout service's agent gateway: a generate function written on it (open_session,
an OpenAI-API agent with the session id as its key, finish_session, drop_session) runs in a rollout against a real
buffer, reward service, router and CPU engine serving a tiny model taught the calculator conversation."""

from __future__ import annotations

import pytest

from services.common.samples import Status
from services.common.settings.rollout import RolloutConfig
from tests.integration.test_agent_rollout import run_rollouts, stack  # noqa: F401 - stack: its module fixture


@pytest.mark.slow  # its own engine and services: about 2 minutes on 2 loaded cores
def test_a_generate_function_on_the_openai_adapter_module_runs_on_the_gateway(stack):  # noqa: F811
    cfg = RolloutConfig(job_id="slime-compat-openai", rollout_batch_size=1, n_samples_per_prompt=1,
                        rollout_temperature=0.0, rollout_max_response_len=200, apply_chat_template=True,
                        rm_type="exact_match", lease_timeout_s=120.0,
                        custom_generate_function_path="tests.slime_compat.plugins.openai_adapter_generate")
    (groups,) = run_rollouts(stack, cfg, [0])
    (sample,) = groups[0].samples
    assert sample.status == Status.COMPLETED and sample.reward == 1.0  # the session's reward, kept
    assert sample.metadata["harness"] == "openai" and sample.metadata["tool"] == "calculator"
    assert sample.metadata["final_text"] == "The answer is 5." and sample.metadata["agent_turns"] == 2
    assert sample.loss_mask[0] == 1 and sample.loss_mask[-1] == 1 and 0 in sample.loss_mask  # the tool result: 0
