"""End to end: the calculator agent example (examples/agent: the openai client with a calculator tool) trains for
two rollouts from a submitted job, through a local stack whose engines serve a tiny tool-calling model; the samples
in the buffer are the gateway sessions' tokens, tool results masked out of the loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from physarum import stack
from services.buffer.client import BufferClient
from tests.e2e.roots import stack_roots
from tests.e2e.test_loop import run
from tests.integration.gateway_fixtures import QUESTION, build_tool_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent"


@pytest.fixture(scope="module")
def agent_stack(session_dir):
    """A stack of its own: its engines serve the tool-calling model (the shared stack's model has no tools
    template)."""
    model = build_tool_model(session_dir / "agent-model")
    work_dir = session_dir / "agent-stack"
    state = stack.up(stack.StackOptions(work_dir=work_dir, model_path=model, num_engines=1, trainer_threads=1,
                                        path_roots=stack_roots(session_dir)))
    yield state, model
    stack.down(work_dir)


def test_calculator_agent_trains_from_a_submitted_job(agent_stack, tmp_path):
    state, model = agent_stack
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"input": QUESTION, "label": "5"}) + "\n" for _ in range(8)))
    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    spec.update(job_id="e2e-agent", hf_checkpoint=str(model), prompt_data=str(train), num_rollout=2,
                rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4, eval_prompt_data=[],
                rollout_temperature=0.5,  # the warmed-up answer is likely at 1.0 and all but certain at 0.5
                weight_sync_timeout_s=60.0, lease_timeout_s=120.0, rollout_timeout_s=400.0, reward_timeout_s=60.0)
    spec.pop("eval_interval")
    job, events = run(state, spec, timeout_s=600.0)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # the engines had the trainer's weights: the trainer's log-probs of the sessions' tokens are the engines'
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    with BufferClient(state["buffer_addr"], timeout_s=30.0) as buffer:
        samples = [s for r in range(2) for g in buffer.get_batch(spec["job_id"], r, 2, timeout_s=5) for s in g.samples]
    assert len(samples) == 8
    for sample in samples:
        turns = sample.metadata["agent_turns"]
        assert turns >= 1 and sample.metadata["agent_branches"] == []
        assert (0 in sample.loss_mask) == (turns > 1)  # a tool result between turns trains nothing
        assert sample.loss_mask[-1] == 1 and len(sample.rollout_log_probs) == sample.response_length
    assert any(sample.reward == 1.0 for sample in samples)
