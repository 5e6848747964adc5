"""RolloutManager against an in-memory buffer and reward and a mocked router (httpx.MockTransport): no sockets."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.common.errors import InvalidArgument
from services.common.samples import Prompt, SampleGroup, Status, group_id_for
from services.common.settings.rollout import RolloutConfig
from services.rollout.client import RolloutState
from services.rollout.generation import engine_weights
from services.rollout.generation.manager import RolloutManager
from services.rollout.generation.prompts import PromptEncoder
from tests.unit.rollout_fakes import (
    JOB,
    Engine,
    FakeBuffer,
    FakeReward,
    ScriptedRouter,
    new_manager,
    reply,
    rollout,
    rollout_config,
    sample_of,
)


@pytest.fixture
def encoder(tiny_model_dir) -> PromptEncoder:
    return PromptEncoder(tiny_model_dir)


def config(**overrides) -> RolloutConfig:
    values = dict(job_id=JOB, rollout_batch_size=3, n_samples_per_prompt=2, rollout_max_response_len=5,
                  rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=0, rollout_stop=["\n"],
                  rollout_stop_token_ids=[3], rm_type="math", lease_timeout_s=5.0, args={"k": 1})
    return RolloutConfig(**{**values, **overrides})


async def run_rollout(buffer, engine, cfg, tiny_model_dir, rollout_id: int = 0, **kwargs):
    kwargs.setdefault("batch_groups", False)  # one request per sample, as the engine fakes count them
    reward = FakeReward()
    manager = RolloutManager(buffer, reward, "http://router", model_path=str(tiny_model_dir), retry_delay_s=0.0,
                             transport=httpx.MockTransport(engine), **kwargs)
    assert manager.status(JOB, rollout_id).state == RolloutState.UNKNOWN
    assert manager.start_rollout(cfg, rollout_id, "v7") is False
    assert manager.start_rollout(cfg, rollout_id, "v7") is True
    run = manager.runs[(JOB, rollout_id)]
    await asyncio.wait_for(asyncio.shield(run.task), 30)
    status = manager.status(JOB, rollout_id)
    await manager.close()
    return status, reward


def test_rollout_writes_scored_groups_built_from_engine_replies(tiny_model_dir, encoder):
    buffer, engine = FakeBuffer(5), Engine()
    status, reward = asyncio.run(run_rollout(buffer, engine, config(), tiny_model_dir))
    assert status.state == RolloutState.DONE and status.num_groups_done == 3 and status.num_groups_target == 3
    assert sorted(buffer.groups) == [group_id_for(JOB, 0, i) for i in range(3)]
    assert not buffer.leased and engine.num_calls == 6
    body = engine.bodies[0]
    assert body["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 5,
                                       "stop": ["\n"], "stop_token_ids": [3], "no_stop_trim": True,
                                       "skip_special_tokens": True}
    assert body["return_logprob"] is True and len({b["rid"] for b in engine.bodies}) == 6
    group = buffer.groups[group_id_for(JOB, 0, 1)]
    prompt_ids = encoder.encode_text("1+1=")
    assert group.rollout_id == 0 and group.prompt_index == 1 and group.lease_id
    assert [s.index for s in group.samples] == [0, 1] and {s.group_index for s in group.samples} == {1}
    sample = group.samples[0]
    assert sample.tokens == prompt_ids + [17, 18, 0] and sample.response_length == 3 and sample.prompt == "1+1="
    assert sample.rollout_log_probs == [-0.5, -1.25, -0.125] and sample.loss_mask == [1, 1, 1]
    assert sample.status == Status.COMPLETED and sample.weight_versions == ["v7"] and sample.label == "2"
    assert sample.reward == 2.0 and sample.reward_scores == {"len": 2.0} and sample.reward_error == ""
    assert reward.calls[0] == {"rm_type": "math", "custom_rm_path": "", "reward_key": "", "timeout_s": 10.0,
                               "args": {"k": 1}}
    assert set(status.metrics) == {"rollout/reward_mean", "rollout/response_len_mean", "rollout/truncated_ratio",
                                   "rollout/samples_per_second"}
    assert status.metrics["rollout/reward_mean"] == 2.0 and status.metrics["rollout/response_len_mean"] == 3.0
    assert status.metrics["rollout/truncated_ratio"] == 0.0 and status.metrics["rollout/samples_per_second"] > 0


def test_length_finish_is_truncated_and_failed_score_keeps_sample(tiny_model_dir):
    class XEngine(Engine):
        def __call__(self, request):
            reply = super().__call__(request)
            data = reply.json()
            data["text"] = "x"
            return httpx.Response(200, json=data)

    buffer = FakeBuffer(3)
    status, _ = asyncio.run(run_rollout(buffer, XEngine(finish="length"), config(), tiny_model_dir))
    samples = [s for g in buffer.groups.values() for s in g.samples]
    assert len(samples) == 6 and all(s.status == Status.TRUNCATED for s in samples)
    assert all(s.reward == 0.0 and s.reward_error == "boom" for s in samples)
    assert status.metrics["rollout/truncated_ratio"] == 1.0


def test_generation_is_retried_while_engines_restart(tiny_model_dir):
    buffer, engine = FakeBuffer(3), Engine(failures=3)
    status, _ = asyncio.run(run_rollout(buffer, engine, config(), tiny_model_dir))
    assert status.state == RolloutState.DONE and len(buffer.groups) == 3 and engine.num_calls == 9


def test_failed_group_returns_its_lease_and_rollout_leases_again(tiny_model_dir, encoder):
    # 2 attempts per sample and prompt 0's first 2 requests fail: its group fails, prompt 1's is written.
    buffer, engine = FakeBuffer(4), Engine(failures=2, fail_input=encoder.encode_text("0+1="))
    status, _ = asyncio.run(run_rollout(buffer, engine, config(rollout_batch_size=2, n_samples_per_prompt=1),
                                        tiny_model_dir, max_generate_attempts=2))
    assert status.state == RolloutState.DONE and len(buffer.groups) == 2
    assert not buffer.leased and buffer.num_leases == 3  # the failed prompt came back and was leased again
    assert engine.num_calls == 4
    assert sorted(g.prompt_index for g in buffer.groups.values()) == [0, 1]


def test_rollout_fails_clearly_after_bounded_rounds(tiny_model_dir):
    buffer, engine = FakeBuffer(10), Engine(failures=10**6)
    status, _ = asyncio.run(run_rollout(buffer, engine, config(rollout_batch_size=1, n_samples_per_prompt=1),
                                        tiny_model_dir, max_generate_attempts=2))
    assert status.state == RolloutState.FAILED and not buffer.groups and not buffer.leased
    assert "3 groups in a row failed" in status.error and "HTTP 503" in status.error
    assert engine.num_calls == 6


def test_rejected_request_fails_the_rollout_at_once(tiny_model_dir):
    buffer, engine = FakeBuffer(3), Engine(failures=1, status_code=400)
    status, _ = asyncio.run(run_rollout(buffer, engine, config(rollout_batch_size=1, n_samples_per_prompt=1),
                                        tiny_model_dir))
    assert status.state == RolloutState.FAILED and "rejected /generate: HTTP 400" in status.error
    assert engine.num_calls == 1 and not buffer.leased and len(buffer.returned) == 1


def test_aborted_generation_is_retried(tiny_model_dir):
    class AbortOnce(Engine):
        def __call__(self, request):
            self.finish = "abort" if self.num_calls == 0 else "stop"
            return super().__call__(request)

    buffer, engine = FakeBuffer(1), AbortOnce()
    status, _ = asyncio.run(run_rollout(buffer, engine, config(rollout_batch_size=1, n_samples_per_prompt=1),
                                        tiny_model_dir))
    assert status.state == RolloutState.DONE and engine.num_calls == 2
    assert buffer.groups[group_id_for(JOB, 0, 0)].samples[0].status == Status.COMPLETED


def test_restarted_rollout_only_tops_up_missing_groups(tiny_model_dir):
    buffer, engine = FakeBuffer(6), Engine()
    first = buffer.lease_prompts(JOB, 0, 2, 5.0)
    buffer.put_groups([SampleGroup(group_id=group_id_for(JOB, 0, p.index), job_id=JOB, rollout_id=0,
                                   prompt_index=p.index, epoch=0, samples=[], lease_id=p.lease_id) for p in first])
    status, _ = asyncio.run(run_rollout(buffer, engine, config(), tiny_model_dir))
    assert status.state == RolloutState.DONE and len(buffer.groups) == 3 and engine.num_calls == 2


def test_sft_rollout_builds_label_responses_without_generation(tiny_model_dir, encoder):
    buffer, engine = FakeBuffer(2), Engine()
    status, reward = asyncio.run(run_rollout(buffer, engine, config(loss_type="sft_loss", rollout_batch_size=2),
                                             tiny_model_dir))
    assert status.state == RolloutState.DONE and engine.num_calls == 0 and not reward.calls
    sample = buffer.groups[group_id_for(JOB, 0, 1)].samples[1]
    label_ids = encoder.encode_text("2") + [encoder.eos_token_id]
    assert sample.tokens == encoder.encode_text("1+1=") + label_ids and sample.response == "2"
    assert sample.response_length == 2 and sample.loss_mask == [1, 1] and sample.rollout_log_probs == [0.0, 0.0]
    assert sample.reward == 0.0 and sample.status == Status.COMPLETED and sample.weight_versions == ["v7"]


def test_sft_on_conversations_trains_the_assistant_turns(tiny_model_dir, encoder):
    from services.rollout.generation.loss_masks import LossMasker, response_length

    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    buffer = FakeBuffer(prompts=[Prompt(job_id=JOB, index=i, epoch=0, messages=chat) for i in range(2)])
    cfg = config(loss_type="sft_loss", rollout_batch_size=2, args={"loss_mask_type": "qwen3"})
    status, reward = asyncio.run(run_rollout(buffer, Engine(), cfg, tiny_model_dir))
    assert status.state == RolloutState.DONE and not reward.calls
    sample = buffer.groups[group_id_for(JOB, 0, 1)].samples[0]
    ids, mask = LossMasker(encoder, "qwen3").tokens_and_mask(chat)
    n = response_length(mask)
    assert (sample.tokens, sample.response_length, sample.loss_mask) == (ids, n, mask[-n:])
    assert sample.response.startswith("2") and sum(sample.loss_mask) == 6  # "2" and "4", each + <|im_end|> + "\n"


def test_sft_without_label_fails_naming_the_prompt(tiny_model_dir):
    buffer = FakeBuffer(1)
    buffer.fresh[0].label = ""
    status, _ = asyncio.run(run_rollout(buffer, Engine(), config(loss_type="sft_loss", rollout_batch_size=1),
                                        tiny_model_dir))
    assert status.state == RolloutState.FAILED and "prompt 0 has neither" in status.error


# ----- over-sampling, abort, dynamic filters, custom generate functions -----

def held_for(prompts: set[int], text: str = "12"):
    """A router script: requests for `prompts` are held until an engine is told to abort, the rest answered."""
    return lambda body, headers: None if sample_of(body)[0] in prompts else reply([17, 18, 0], text)


def test_oversampling_aborts_the_surplus_and_gives_its_prompts_back(tiny_model_dir):
    buffer = FakeBuffer(8)
    router = ScriptedRouter(script=held_for({2, 3}))
    manager, _ = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(rollout_batch_size=2, over_sampling_batch_size=4)

    async def run():
        first = await rollout(manager, cfg, 0)
        router.script = held_for(set())
        second = await rollout(manager, rollout_config(rollout_batch_size=2), 1)
        await manager.close()
        return first, second

    first, second = asyncio.run(run())
    assert first.state == second.state == RolloutState.DONE
    assert [g.prompt_index for g in buffer.rollout_groups(0)] == [0, 1]  # 4 leased, the 2 that finished written
    assert router.num_held == 4  # both samples of prompts 2 and 3 were running when the batch filled
    assert router.aborts == [("http://engine-1/abort_request", {"abort_all": True}),
                             ("http://engine-2/abort_request", {"abort_all": True})]
    # The surplus prompts came back and were served first: none lost, none generated twice.
    assert [g.prompt_index for g in buffer.rollout_groups(1)] == [2, 3]
    assert not buffer.leased and not buffer.returned and buffer.num_leases == 6 and len(buffer.groups) == 4


def test_dynamic_filter_drops_are_counted_and_refilled(tiny_model_dir):
    buffer = FakeBuffer(6)
    router = ScriptedRouter(script=lambda body, headers: reply([17, 18, 0], "12"))
    manager, _ = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(rollout_batch_size=2, dynamic_sampling_filter_path="tests.plugins.rollout_fns."
                                                                            "drop_odd_prompts_with_reason")
    status = asyncio.run(rollout(manager, cfg, 0))
    asyncio.run(manager.close())
    assert status.state == RolloutState.DONE and status.num_groups_done == 2
    assert [g.prompt_index for g in buffer.rollout_groups(0)] == [0, 2]
    # prompt 1 was dropped: stored under rollout -1 (its prompt used up for the epoch, as in slime), lease acked
    assert [g.prompt_index for g in buffer.rollout_groups(-1)] == [1] and not buffer.leased and not buffer.returned
    assert status.metrics["rollout/dynamic_filter/drop_odd_prompt"] == 1.0
    assert status.metrics["rollout/reward_mean"] == 2.0  # only the written groups count


def test_zero_std_filter_with_fallback_keeps_groups_rather_than_sample_again(tiny_model_dir):
    buffer = FakeBuffer(8)
    router = ScriptedRouter(script=lambda body, headers: reply([17, 18, 0], "12"))  # every group has zero std
    manager, _ = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(rollout_batch_size=2, over_sampling_batch_size=4,
                         dynamic_sampling_filter_path="check_reward_nonzero_std_with_fallback")
    status = asyncio.run(rollout(manager, cfg, 0))
    asyncio.run(manager.close())
    # 4 in flight: the first two to finish are dropped (3 and 2 remain for 2 slots), the last two kept.
    assert status.state == RolloutState.DONE and len(buffer.rollout_groups(0)) == 2
    assert len(buffer.rollout_groups(-1)) == 2 and status.metrics["rollout/dynamic_filter/drop_zero_std_2.0"] == 2.0
    assert buffer.num_leases == 4 and not router.aborts  # no second sampling round, nothing to abort


def test_a_filter_that_drops_everything_fails_the_rollout_clearly(tiny_model_dir):
    buffer = FakeBuffer(100)
    router = ScriptedRouter(script=lambda body, headers: reply([17, 18, 0], "12"))
    manager, _ = new_manager(buffer, router, tiny_model_dir)
    status = asyncio.run(rollout(manager, rollout_config(rollout_batch_size=1,
                                                         dynamic_sampling_filter_path="check_reward_nonzero_std"), 0))
    asyncio.run(manager.close())
    assert status.state == RolloutState.FAILED and "dropped 20 groups in a row" in status.error
    assert not buffer.leased
    with pytest.raises(InvalidArgument, match="drops every group of one sample"):
        asyncio.run(rollout(manager, rollout_config(n_samples_per_prompt=1,
                                                    dynamic_sampling_filter_path="check_reward_nonzero_std"), 1))


def multi_turn_router():
    counter = iter(range(10**6))
    return ScriptedRouter(script=lambda body, headers: reply([20 + next(counter) % 50, 21], "ab", weight_version="v3"))


@pytest.mark.parametrize("policy", ["round_robin", "manual", "consistent_hashing"])
def test_custom_generate_function_masks_tool_tokens_and_keeps_each_sample_on_one_session(tiny_model_dir, policy):
    buffer, router = FakeBuffer(2), multi_turn_router()
    manager, _ = new_manager(buffer, router, tiny_model_dir, router_policy=policy)
    cfg = rollout_config(rollout_batch_size=2, custom_generate_function_path="tests.plugins.rollout_fns."
                                                                             "model_tool_model")
    status = asyncio.run(rollout(manager, cfg, 0))
    asyncio.run(manager.close())
    assert status.state == RolloutState.DONE and len(router.requests) == 12  # 2 prompts x 2 samples x 3 turns
    for group in buffer.rollout_groups(0):
        for sample in group.samples:
            model = sample.tokens[sample.prompt_length:]
            assert model[2:4] == model[6:8] == [5, 6] and sample.response_length == 10
            assert sample.loss_mask == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
            assert sample.rollout_log_probs == [-0.5, -1.5, 0.0, 0.0, -0.5, -1.5, 0.0, 0.0, -0.5, -1.5]
            assert sample.weight_versions == ["v3"] * 3 and sample.response == "ab<tool>ab<tool>ab"
    keys = {}
    for body, headers in router.requests:
        keys.setdefault(sample_of(body), set()).add(headers.get("X-SMG-Routing-Key"))
    if policy == "round_robin":
        assert all(k == {None} for k in keys.values())
    else:  # one key per sample, all different
        assert all(len(k) == 1 and None not in k for k in keys.values()) and len(set.union(*keys.values())) == 4


def test_a_bad_plugin_path_fails_at_start(tiny_model_dir):
    manager, _ = new_manager(FakeBuffer(2), Engine(), tiny_model_dir)
    with pytest.raises(InvalidArgument, match="custom_generate_function_path: 'nope.generate' is not under an allowed"):
        manager.start_rollout(rollout_config(custom_generate_function_path="nope.generate"), 0, "v1")
    with pytest.raises(InvalidArgument, match="group_rm needs custom_rm_path"):
        manager.start_rollout(rollout_config(group_rm=True), 0, "v1")
    assert not manager.runs
    asyncio.run(manager.close())


def test_a_fully_async_stream_keeps_its_bound_records_start_versions_and_stops_cleanly(tiny_model_dir):
    """Stream of max_inflight_groups 4 over 10 prompts: 4 groups are written and no more while none is taken; a
    request sent at the pool's version 3 and answered by version 4 records both; StopRollout returns nothing leased
    (all written) and ends DONE; taking two groups lets the restarted stream write two more."""
    from services.buffer.client import STREAM_ROLLOUT_ID

    async def main() -> None:
        buffer = FakeBuffer(num_prompts=10)
        version = {"now": "3"}

        def answer(body, headers):
            version["now"] = "4"  # a weight update lands while the request runs
            return reply([17, 18, 0], "12", weight_version="4")

        manager, _ = new_manager(buffer, ScriptedRouter(answer), tiny_model_dir, version_now=lambda: version["now"])
        cfg = rollout_config(max_inflight_groups=4)
        with pytest.raises(InvalidArgument, match="stream"):
            manager.start_rollout(cfg, 0, "3")
        assert manager.start_rollout(cfg, STREAM_ROLLOUT_ID, "3") is False
        for _ in range(100):
            if buffer.count_groups(JOB, STREAM_ROLLOUT_ID) == 4:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.6)  # longer than the stream's poll: it must not write a fifth
        groups = buffer.rollout_groups(STREAM_ROLLOUT_ID)
        assert [g.prompt_index for g in groups] == [0, 1, 2, 3]
        assert groups[0].samples[0].weight_versions == ["3", "4"]  # started at 3, ended at 4
        assert {tuple(s.weight_versions) for g in groups[1:] for s in g.samples} == {("4",)}
        status = await manager.stop_rollout(JOB, STREAM_ROLLOUT_ID)
        assert (status.state, status.error, buffer.leased) == (RolloutState.DONE, "", {})
        for group in groups[:2]:  # the trainer takes two
            group.rollout_id = 0
        assert manager.start_rollout(cfg, STREAM_ROLLOUT_ID, "4") is False  # a stopped stream starts again
        for _ in range(100):
            if buffer.count_groups(JOB, STREAM_ROLLOUT_ID) == 4:
                break
            await asyncio.sleep(0.05)
        assert [g.prompt_index for g in buffer.rollout_groups(STREAM_ROLLOUT_ID)] == [2, 3, 4, 5]
        await manager.close()

    asyncio.run(main())


def test_a_restarted_managers_rollout_waits_for_the_trainers_weights(tiny_model_dir, monkeypatch):
    """A new manager's pool holds no weights (None): a rollout the trainer started at version 2 sends no /generate
    until the pool holds 2 (the trainer's announce), then completes with that version on every sample; one started
    at version 0 (the engines' starting checkpoint) does not wait; a pool that never gets there fails the rollout
    naming both versions."""

    async def main() -> None:
        buffer = FakeBuffer(num_prompts=6)
        version: dict[str, str | None] = {"now": None}
        router = ScriptedRouter(lambda body, headers: reply([17, 18, 0], "12", weight_version=version["now"] or ""))
        manager, _ = new_manager(buffer, router, tiny_model_dir, version_now=lambda: version["now"])
        manager.start_rollout(rollout_config(), 1, "2")
        await asyncio.sleep(1.0)  # five polls of the pool's version
        assert router.requests == [] and manager.status(JOB, 1).state == RolloutState.RUNNING
        version["now"] = "2"  # the trainer announced its snapshot; the engines loaded it
        await asyncio.wait_for(asyncio.shield(manager.runs[(JOB, 1)].task), 30)
        assert manager.status(JOB, 1).state == RolloutState.DONE
        assert {v for g in buffer.rollout_groups(1) for s in g.samples for v in s.weight_versions} == {"2"}
        await manager.close()

        version["now"] = None
        manager, _ = new_manager(FakeBuffer(num_prompts=3), router, tiny_model_dir, version_now=lambda: version["now"])
        assert (await rollout(manager, rollout_config(), 0, "0")).state == RolloutState.DONE
        monkeypatch.setattr(engine_weights, "WAIT_S", 0.5)
        status = await rollout(manager, rollout_config(), 1, "3")
        assert status.state == RolloutState.FAILED
        assert "the engines hold weight version None, not the trainer's 3" in status.error
        await manager.close()

    asyncio.run(main())


class LoggingBuffer(FakeBuffer):
    """Records how many groups each PutGroups carried."""

    def __init__(self, num_prompts: int) -> None:
        super().__init__(num_prompts)
        self.puts: list[int] = []

    def put_groups(self, groups):
        self.puts.append(len(groups))
        return super().put_groups(groups)


def test_groups_that_finish_together_are_written_in_one_call_and_never_past_the_batch(tiny_model_dir):
    buffer = LoggingBuffer(10)
    manager, reward = new_manager(buffer, ScriptedRouter(script=lambda body, headers: reply([17, 18, 0], "12")),
                                  tiny_model_dir)

    async def main():
        try:
            return await rollout(manager, config(rollout_batch_size=6, over_sampling_batch_size=8), 0)
        finally:
            await manager.close()

    status = asyncio.run(main())
    assert status.state == RolloutState.DONE and status.num_groups_done == 6 and buffer.count_groups(JOB, 0) == 6
    assert sum(buffer.puts) == 6 and len(buffer.puts) < 6  # batched, and the 2 surplus groups were not written
    assert len(reward.calls) < 6 and status.metrics["rollout/reward_mean"] == 2.0  # scored in batches, recorded


def test_a_batch_with_a_group_already_stored_takes_the_count_from_the_buffer(tiny_model_dir):
    buffer = LoggingBuffer(5)
    stored = SampleGroup(group_id=group_id_for(JOB, 0, 0), job_id=JOB, rollout_id=0, prompt_index=0, epoch=0,
                         samples=[])
    buffer.groups[stored.group_id] = stored  # as if a PutGroups retried after its reply was lost had written it
    status, _ = asyncio.run(run_rollout(buffer, Engine(), config(rollout_batch_size=3), tiny_model_dir))
    assert status.state == RolloutState.DONE and status.num_groups_done == 3
    assert buffer.count_groups(JOB, 0) == 3 and buffer.groups[stored.group_id] is stored
    assert not buffer.leased
