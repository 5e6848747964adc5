"""slime.rollout's plugin surface (sglang_rollout, base_types, filter_hub, rm_hub, data_source) and slime.utils
(misc, types), called as slime's docs and examples call them: in the rollout manager against the in-memory buffer
and reward (reward = the response's length) and a scripted router, and alone where slime's code runs alone."""

from __future__ import annotations

import asyncio

import pytest
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.filter_hub.base_types import (
    DynamicFilterOutput,
    MetricGatherer,
    call_dynamic_filter,
    should_drop_dynamic_filter_output,
)
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.misc import load_function
from slime.utils.types import Sample

from services.rollout.client import RolloutState
from tests.unit.rollout_fakes import Engine, FakeBuffer, new_manager, rollout, rollout_config


def config(tiny_model_dir, **overrides):
    args = {"hf_checkpoint": str(tiny_model_dir), "rollout_temperature": 1.0, "rollout_top_p": 1.0,
            "rollout_top_k": -1, "rollout_max_response_len": 5, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
            "my_filter_path": "tests.slime_compat.plugins.drop_prompt_one", **overrides.pop("args", {})}
    values = dict(rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=5, args=args,
                  rollout_function_path="tests.slime_compat.plugins.generate_rollout")
    return rollout_config(**{**values, **overrides})


def run_rollout(buffer, cfg, tiny_model_dir, engine=None):
    async def main():
        manager, reward = new_manager(buffer, engine or Engine(), tiny_model_dir)
        try:
            return await rollout(manager, cfg, 0), reward
        finally:
            await manager.close()
    return asyncio.run(main())


def test_a_rollout_function_on_generate_and_rm_and_call_dynamic_filter(tiny_model_dir):
    """Each sample generated through the router and scored by the reward service (reward len("12") = 2); prompt 1
    dropped by the legacy bool filter (its lease given back to the buffer); the drop count reaches the rollout's
    metrics."""
    buffer = FakeBuffer(6)
    status, reward = run_rollout(buffer, config(tiny_model_dir), tiny_model_dir)
    assert status.state == RolloutState.DONE, status.error
    groups = buffer.rollout_groups(0)
    assert [g.prompt_index for g in groups] == [0, 2]
    for group in groups:
        assert [s.reward for s in group.samples] == [2.0, 2.0]
        assert all(s.tokens[-3:] == [17, 18, 0] and s.rollout_log_probs == [-0.5, -1.25, -0.125]
                   for s in group.samples)
    assert reward.calls and all(call["rm_type"] == "math" for call in reward.calls)
    assert status.metrics["rollout/function/dynamic_filter/drop_prompt_one"] == 1.0
    assert not buffer.leased and len(buffer.returned) == 1  # prompt 1's lease, given back: no prompt is lost


def test_a_generate_function_scoring_with_async_rm_goes_through_the_reward_service(tiny_model_dir):
    """The service's own loop with a custom generate function that calls async_rm: the reward service scores it
    (len("12") = 2), and the service keeps the reward the function set."""
    buffer = FakeBuffer(2)
    cfg = rollout_config(rollout_batch_size=2, n_samples_per_prompt=2, rm_type="math",
                         custom_generate_function_path="tests.slime_compat.plugins.generate_then_score",
                         args={"hf_checkpoint": str(tiny_model_dir)})
    status, reward = run_rollout(buffer, cfg, tiny_model_dir)
    assert status.state == RolloutState.DONE, status.error
    samples = [s for g in buffer.rollout_groups(0) for s in g.samples]
    assert len(samples) == 4 and all(s.reward == 2.0 and s.metadata["scored_in_generate"] for s in samples)
    # the four async_rm calls, waiting together, went out as one reward-service call; none after: the reward was set
    assert len(reward.calls) == 1


def test_call_dynamic_filter_and_the_drop_rule_as_slime_defines_them():
    group = [Sample(reward=1.0), Sample(reward=1.0)]
    assert call_dynamic_filter(None, None, group) == DynamicFilterOutput(keep=True)
    assert call_dynamic_filter(lambda args, samples: False, None, group) == DynamicFilterOutput(keep=False)
    verdict = call_dynamic_filter(check_reward_nonzero_std, None, group)
    assert verdict == DynamicFilterOutput(keep=False, reason="zero_std_1.0")
    lenient = DynamicFilterOutput(keep=False, keep_when_insufficient=True)
    assert should_drop_dynamic_filter_output(verdict, remaining_batch_size=2, target_data_size=4)
    assert not should_drop_dynamic_filter_output(lenient, remaining_batch_size=4, target_data_size=4)
    assert should_drop_dynamic_filter_output(lenient, remaining_batch_size=5, target_data_size=4)
    gatherer = MetricGatherer()
    for reason in ("zero_std_1.0", "zero_std_1.0", None, "too_long"):
        gatherer.on_dynamic_filter_drop(reason)
    assert gatherer.collect() == {"rollout/dynamic_filter/drop_zero_std_1.0": 2,
                                  "rollout/dynamic_filter/drop_too_long": 1}


def test_call_rollout_fn_wraps_a_legacy_return_and_load_function_finds_a_plugin():
    groups = [[Sample(index=0)]]
    train = call_rollout_fn(lambda args, rollout_id, data_source, evaluation: groups, None, 0, None, evaluation=False)
    assert train == RolloutFnTrainOutput(samples=groups)
    evaluated = call_rollout_fn(lambda *a, evaluation: {"d": {"rewards": [1.0]}}, None, 0, None, evaluation=True)
    assert evaluated == RolloutFnEvalOutput(data={"d": {"rewards": [1.0]}})
    fn = load_function("tests.slime_compat.plugins.eval_rollout")
    assert fn(None, 3, None, evaluation=True).metrics == {"eval/made_up_calls": 1}


def test_async_rm_outside_a_rollout_runs_slimes_rule_based_reward():
    """In the reward service (a custom reward that calls slime's), async_rm runs rm_type here."""
    args = type("Args", (), {"rm_type": "math", "custom_rm_path": None, "group_rm": False})()
    right = Sample(response="so \\boxed{4}", label="4")
    wrong = Sample(response="so \\boxed{5}", label="4")
    assert asyncio.run(async_rm(args, right)) == 1
    assert asyncio.run(batched_async_rm(args, [right, wrong])) == [1, 0]


@pytest.mark.parametrize("field, default", [("status", Sample.Status.PENDING), ("reward", None), ("loss_mask", None),
                                            ("response_length", 0), ("metadata", {})])
def test_sample_has_slimes_fields_and_defaults(field, default):
    assert getattr(Sample(), field) == default


def test_generate_and_rm_runs_a_samples_own_generate_function_and_scores_its_fan_out(tiny_model_dir):
    """sample.generate_function_path wins over the job's; its list comes back as a list; the sample without a reward
    is scored by the reward service (len("12") = 2), the one with its own (0.25) is kept."""
    buffer = FakeBuffer(2)
    status, reward = run_rollout(buffer, config(
        tiny_model_dir, rollout_function_path="tests.slime_compat.plugins.rollout_with_fan_out"), tiny_model_dir)
    assert status.state == RolloutState.DONE, status.error
    for group in buffer.rollout_groups(0):
        assert [s.reward for s in group.samples] == [2.0, 0.25, 2.0, 0.25]
        assert all(s.metadata["evaluation"] is False for s in group.samples)
    assert reward.calls


def test_generate_and_rm_group_sends_the_sampling_params_it_is_given_and_holds_a_dp_rank_per_group(tiny_model_dir):
    """slime's fully-async call, generate_and_rm_group(args, group, sampling_params=..., evaluation=False), for two
    groups at once: the router gets the given max_new_tokens and temperature (the job's: 5 and 1.0), the groups
    are scored, and each holds its own of the two data-parallel ranks while its samples generate."""
    buffer, engine = FakeBuffer(2, job_id="own-sampling"), Engine()  # its own job: its own GenerateState
    cfg = config(tiny_model_dir, rollout_function_path="tests.slime_compat.plugins.rollout_with_own_sampling",
                 custom_generate_function_path="tests.slime_compat.plugins.generate_recording_dp_ranks",
                 job_id="own-sampling", args={"sglang_dp_size": 2})
    status, _ = run_rollout(buffer, cfg, tiny_model_dir, engine)
    assert status.state == RolloutState.DONE, status.error
    assert len(engine.bodies) == 4
    assert all((b["sampling_params"]["max_new_tokens"], b["sampling_params"]["temperature"]) == (2, 0.5)
               for b in engine.bodies)
    samples = [s for g in buffer.rollout_groups(0) for s in g.samples]
    assert [s.reward for s in samples] == [2.0] * 4
    assert all(s.metadata["dp_counts"] == [1, 1] for s in samples)  # both groups' ranks busy, one each


def test_dp_rank_context_picks_the_least_busy_rank_and_frees_it(tiny_model_dir):
    args = type("Args", (), {"hf_checkpoint": str(tiny_model_dir), "job_id": "dp-ranks", "sglang_dp_size": 3,
                             "rollout_temperature": 1.0, "rollout_top_p": 1.0, "rollout_top_k": -1,
                             "rollout_max_response_len": 4})()
    state = GenerateState(args)
    with state.dp_rank_context() as first, state.dp_rank_context() as second, state.dp_rank_context() as third:
        assert sorted([first, second, third]) == [0, 1, 2] and state.dp_rank == third
        with state.dp_rank_context() as fourth:
            assert state.dp_counts[fourth] == 2 and sum(state.dp_counts) == 4
        with state.dp_rank_context():
            pass
    assert state.dp_counts == [0, 0, 0]
