"""A group's fresh samples in one /generate (a batch of input_ids): one request per group under the default generate
function, one reply per sample in order, the batch retried as a whole, and per-sample requests where samples route
by their own session (sticky policies)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.common.errors import FailedPrecondition
from services.common.plugin_sample import PluginSample
from services.common.samples import Status, group_id_for
from services.rollout.client import RolloutState
from services.rollout.engine_calls import generate as gen
from services.rollout.engine_calls.router_http import HttpxPoster
from tests.unit.rollout_fakes import JOB, Engine, FakeBuffer, new_manager, reply, rollout, rollout_config


def run(engine: Engine, tiny_model_dir, **manager_options):
    buffer = FakeBuffer(5)
    manager, _ = new_manager(buffer, engine, tiny_model_dir, batch_groups=True, **manager_options)

    async def main():
        try:
            return await rollout(manager, rollout_config(rollout_batch_size=3, n_samples_per_prompt=4), 0)
        finally:
            await manager.close()

    return asyncio.run(main()), buffer


def test_a_group_is_one_request_whose_replies_become_its_samples_in_order(tiny_model_dir):
    engine = Engine()
    status, buffer = run(engine, tiny_model_dir)
    assert status.state == RolloutState.DONE and engine.num_calls == 3
    for body in engine.bodies:
        assert len(body["input_ids"]) == 4 and all(ids == body["input_ids"][0] for ids in body["input_ids"])
        assert "rid" not in body and body["return_logprob"] is True and body["sampling_params"]["max_new_tokens"] == 5
    group = buffer.groups[group_id_for(JOB, 0, 1)]
    assert [s.index for s in group.samples] == [0, 1, 2, 3]
    for sample in group.samples:
        assert sample.tokens[-3:] == [17, 18, 0] and sample.rollout_log_probs == [-0.5, -1.25, -0.125]
        assert sample.status == Status.COMPLETED and sample.reward == 2.0 and sample.loss_mask == [1, 1, 1]


def test_a_failed_batch_is_retried_whole(tiny_model_dir):
    engine = Engine(failures=2)
    status, buffer = run(engine, tiny_model_dir)
    assert status.state == RolloutState.DONE and engine.num_calls == 5 and len(buffer.groups) == 3


def test_sticky_policies_keep_a_request_per_sample(tiny_model_dir):
    engine = Engine()
    status, _ = run(engine, tiny_model_dir, router_policy="consistent_hashing")
    assert status.state == RolloutState.DONE and engine.num_calls == 12
    assert all(isinstance(body["input_ids"][0], int) and body["rid"] for body in engine.bodies)


def call_batch(handler, aborting: bool = False) -> list[dict]:
    async def main():
        ctx = gen.GenerateContext(http=HttpxPoster(httpx.AsyncClient(transport=httpx.MockTransport(handler))),
                                  router_url="http://router", name="rollout 0 of job j", rid_prefix="j-0",
                                  retry_delay_s=0.0, max_attempts=2, aborting=aborting)
        gen.use_context(ctx)
        samples = [PluginSample(group_index=2, index=j) for j in range(3)]
        try:
            return await gen.router_generate_batch(samples, {"input_ids": [[1]] * 3})
        finally:
            await ctx.http.aclose()

    return asyncio.run(main())


def test_a_batch_reply_of_the_wrong_length_is_refused_and_an_aborted_rollout_sends_nothing():
    with pytest.raises(FailedPrecondition, match="prompt 2 samples 0-2: a /generate batch of 3 prompts got 2 replies"):
        call_batch(lambda request: httpx.Response(200, json=[reply([3], "a")] * 2))
    sent = []
    replies = call_batch(lambda request: sent.append(request) or httpx.Response(200, json=[]), aborting=True)
    assert not sent and [r["meta_info"]["finish_reason"]["type"] for r in replies] == ["abort"] * 3
