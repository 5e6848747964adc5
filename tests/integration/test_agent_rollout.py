"""Agents as rollouts: an in-process rollout manager with its gateway runs the calculator agent example
(examples/agent) per sample against real buffer, reward service, router and CPU engine; the groups it writes hold the
sessions' exact tokens, masks and rewards. A stuck agent is cut at agent_timeout_s with the trajectory so far."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.buffer.client import BufferClient
from services.common import procs
from services.common.grpc_client import wait_for_health
from services.common.rest import RestServer
from services.common.samples import Status
from services.common.settings.rollout import RolloutConfig
from services.reward.client import RewardClient
from services.rollout.client import RolloutState
from services.rollout.gateway.app import create_app
from services.rollout.gateway.sessions import SessionRegistry
from services.rollout.generation.agents import AgentGateway
from services.rollout.generation.manager import RolloutManager
from testkit.engines import start_engines, stop_engines
from tests.integration.engine_proxy import EngineProxy
from tests.integration.gateway_fixtures import QUESTION, build_tool_model


@pytest.fixture(scope="module")
def stack(redis_url, shared_router, session_dir):
    model_dir = build_tool_model(session_dir / "agent-model")
    work = session_dir / "agent-rollout"
    work.mkdir(exist_ok=True)
    ports = {name: procs.free_port() for name in ("buffer", "reward")}
    started = []
    engines = start_engines(model_dir, work, 1)
    proxy = EngineProxy(engines[0][1])
    try:
        for name, args in (("buffer", ["--redis-url", redis_url]), ("reward", ["--rest-port", str(procs.free_port())])):
            argv = procs.python_module(f"services.{name}", "--host", procs.HOST, "--port", str(ports[name]), *args)
            started.append(procs.ManagedProcess(name, argv, work / f"{name}.log").start())
        shared_router.add_worker(proxy.url, timeout_s=30)
        for name in ("buffer", "reward"):
            wait_for_health(f"{procs.HOST}:{ports[name]}", timeout_s=60)
        yield {"buffer_addr": f"{procs.HOST}:{ports['buffer']}", "reward_addr": f"{procs.HOST}:{ports['reward']}",
               "router": shared_router.url, "model": model_dir, "work": work, "proxy": proxy}
    finally:
        proxy.close()
        for proc in reversed(started):
            proc.stop()
        stop_engines(engines)


def run_rollouts(stack, cfg: RolloutConfig, rollout_ids: list[int], num_prompts: int = 1):
    """Load the job's prompts, run its rollouts on a manager with a gateway, return each rollout's groups."""
    path = stack["work"] / f"{cfg.job_id}.jsonl"
    path.write_text("".join(json.dumps({"input": QUESTION, "label": "5"}) + "\n" for _ in range(num_prompts)))

    async def main():
        with BufferClient(stack["buffer_addr"], timeout_s=30.0) as buffer, \
                RewardClient(stack["reward_addr"], timeout_s=60.0) as reward:
            assert buffer.load_dataset(cfg.job_id, str(path), label_key="label",
                                       apply_chat_template=True).num_prompts == num_prompts
            registry = SessionRegistry()
            server = RestServer(create_app(registry), procs.HOST, 0)
            await server.start()
            manager = RolloutManager(buffer, reward, stack["router"], model_path=str(stack["model"]),
                                     gateway=AgentGateway(registry, f"http://{procs.HOST}:{server.port}/v1"))
            try:
                for rollout_id in rollout_ids:
                    manager.start_rollout(cfg, rollout_id, "v")
                    await asyncio.wait_for(asyncio.shield(manager.runs[(cfg.job_id, rollout_id)].task), 300)
                    status = manager.status(cfg.job_id, rollout_id)
                    assert status.state == RolloutState.DONE, status.error
                assert len(registry) == 0  # every session was closed
            finally:
                await manager.close()
                await server.stop()
            return [buffer.get_batch(cfg.job_id, r, cfg.rollout_batch_size, timeout_s=10) for r in rollout_ids]

    return asyncio.run(main())


def test_calculator_agent_rollouts_train_the_sessions_tokens(stack):
    cfg = RolloutConfig(job_id="agent-calc", rollout_batch_size=1, n_samples_per_prompt=2, rollout_temperature=0.0,
                        rollout_max_response_len=200, agent_function_path="examples.agent.calculator.agent",
                        custom_rm_path="examples.agent.reward.reward", apply_chat_template=True,
                        lease_timeout_s=120.0, reward_timeout_s=60.0)
    start = len(stack["proxy"].generated)
    batches = run_rollouts(stack, cfg, [0, 1])
    samples = [s for groups in batches for group in groups for s in group.samples]
    assert len(samples) == 4
    records = stack["proxy"].since(start)
    for sample in samples:
        assert sample.status == Status.COMPLETED and sample.reward == 1.0, sample.reward_error
        assert sample.metadata["agent_turns"] == 2 and sample.metadata["agent_branches"] == []
        assert sample.metadata["agent_final_content"] == "The answer is 5."
        # the sample ends with an engine reply to a request that was the sample's tokens before it: the same token
        # ids and log-probs (the two samples of a group ask the same, and batching moves log-probs in the 6th digit)
        ends = []
        for request, reply in records:
            ids, entries = request["input_ids"], reply["meta_info"]["output_token_logprobs"]
            ends.append((ids + [e[1] for e in entries], [e[0] for e in entries]))
        assert any(sample.tokens == tokens and sample.rollout_log_probs[-len(lps):] == lps for tokens, lps in ends)
        num_last = next(len(lps) for tokens, lps in ends if tokens == sample.tokens)
        assert sample.loss_mask[-num_last:] == [1] * num_last
        assert 0 < sample.loss_mask.count(0) < sample.response_length  # the tool result trains nothing


def test_a_stuck_agent_is_cut_at_its_timeout_with_its_reward(stack):
    cfg = RolloutConfig(job_id="agent-stuck", rollout_batch_size=1, n_samples_per_prompt=1,
                        rollout_max_response_len=50, agent_function_path="tests.plugins.agent_fns.stalling_agent",
                        rm_type="exact_match", agent_timeout_s=3.0, lease_timeout_s=120.0)
    (groups,) = run_rollouts(stack, cfg, [0])
    (sample,) = groups[0].samples
    assert sample.status == Status.TRUNCATED and sample.reward == 0.25
    assert sample.response_length == 3 and sample.loss_mask == [1, 1, 1]


def test_a_slime_generate_function_on_slime_agent_adapters_runs_unchanged(stack):
    cfg = RolloutConfig(job_id="agent-slime", rollout_batch_size=1, n_samples_per_prompt=1, rollout_temperature=0.0,
                        rollout_max_response_len=200, apply_chat_template=True, rm_type="exact_match",
                        custom_generate_function_path="tests.plugins.agent_fns.slime_style_generate",
                        lease_timeout_s=120.0)
    (groups,) = run_rollouts(stack, cfg, [0])
    (sample,) = groups[0].samples
    assert sample.status == Status.COMPLETED and sample.reward == 1.0
    assert sample.metadata["harness"] == "anthropic" and sample.metadata["agent_turns"] == 2
    assert sample.metadata["agent_final_content"] == "The answer is 5."
    assert sample.loss_mask[0] == 1 and sample.loss_mask[-1] == 1 and 0 in sample.loss_mask


def test_an_agent_that_spawns_a_sub_agent_yields_a_trajectory_each_in_the_prompts_group(stack):
    """Each sample of the prompt runs the calculator agent and a sub-agent on a session it spawns: the group holds
    both trajectories of both samples, each its own session's engine tokens with its own reward, one prompt's; the
    trainer's baseline is then over the four (fanned_out_groups), not over rows cut every n."""
    from services.trainer.step.rl_step import fanned_out_groups

    cfg = RolloutConfig(job_id="agent-spawn", rollout_batch_size=1, n_samples_per_prompt=2, rollout_temperature=0.0,
                        rollout_max_response_len=200, agent_function_path="tests.plugins.agent_fns.spawning_agent",
                        rm_type="exact_match", apply_chat_template=True, lease_timeout_s=120.0, reward_timeout_s=60.0)
    start = len(stack["proxy"].generated)
    (groups,) = run_rollouts(stack, cfg, [0])
    (group,) = groups
    samples = group.samples
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert [s.metadata["agent_turns"] for s in samples] == [2, 1, 2, 1]
    assert len({s.group_index for s in samples}) == 1 and [s.index for s in samples] == [0, 1, 2, 3]
    assert samples[0].tokens == samples[2].tokens != samples[1].tokens == samples[3].tokens  # greedy
    ends = [request["input_ids"] + [e[1] for e in reply["meta_info"]["output_token_logprobs"]]
            for request, reply in stack["proxy"].since(start)]
    assert all(sample.tokens in ends for sample in samples)
    assert [s.status for s in samples] == [Status.COMPLETED, Status.TRUNCATED] * 2  # the sub-agent's max_tokens
    sub = samples[1]
    assert sub.response_length == 3 and sub.loss_mask == [1, 1, 1]  # the sub-agent's turn: its prompt is its own
    assert sub.prompt.count("<|im_start|>user") == 1
    assert fanned_out_groups(samples, cfg.n_samples_per_prompt) == [0] * 4  # one group of four rows
