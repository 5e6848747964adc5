"""slime's rollout function, data source and buffer filter in the rollout manager (rollout_function.py,
data_source.py, compat slime.rollout.data_source), against the in-memory buffer and reward and a mocked router."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import InvalidArgument
from services.common.samples import group_id_for
from services.rollout.client import RolloutState
from services.rollout.generation import rollout_function
from tests.plugins import slime_rollout
from tests.unit.rollout_fakes import (
    JOB,
    Engine,
    FakeBuffer,
    ScriptedRouter,
    new_manager,
    reply,
    rollout,
    rollout_config,
    sample_of,
)

FN = "tests.plugins.slime_rollout.generate_rollout"


def config(tiny_model_dir, tmp_path, **overrides):
    """A job with slime's rollout function: `args` holds what slime's GenerateState reads."""
    args = {"hf_checkpoint": str(tiny_model_dir), "rollout_temperature": 1.0, "rollout_top_p": 1.0,
            "rollout_top_k": -1, "rollout_max_response_len": 5, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
            "save": str(tmp_path / "ckpt"), "save_interval": 2, "num_rollout": 2,
            "buffer_filter_path": overrides.get("buffer_filter_path", "")}
    values = dict(rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=5, args=args,
                  rollout_function_path=FN, data_source_path="tests.plugins.slime_rollout.TaggedDataSource")
    return rollout_config(**{**values, **overrides})


def run_two(buffer, cfg, tiny_model_dir):
    async def main():
        manager, reward = new_manager(buffer, Engine(), tiny_model_dir)
        try:
            return [await rollout(manager, cfg, rollout_id) for rollout_id in (0, 1)], reward
        finally:
            await manager.close()
    return asyncio.run(main())


def test_two_rollouts_of_a_users_function_reach_the_buffer_scored_with_the_filter_taking_kept_groups(
        tiny_model_dir, tmp_path):
    buffer = FakeBuffer(8)
    cfg = config(tiny_model_dir, tmp_path, buffer_filter_path="tests.plugins.slime_rollout.take_newest")
    statuses, reward = run_two(buffer, cfg, tiny_model_dir)
    assert [s.state for s in statuses] == [RolloutState.DONE] * 2, [s.error for s in statuses]
    first, second = buffer.rollout_groups(0), buffer.rollout_groups(1)
    # rollout 0 leased prompts 0, 1, 2 and gave 2 back to its data source; rollout 1 took 2 out through the filter
    assert [g.prompt_index for g in first] == [0, 1] and [g.prompt_index for g in second] == [2, 3]
    assert [g.group_id for g in second] == [group_id_for(JOB, 0, 2), group_id_for(JOB, 0, 3)]
    taken = {g.prompt_index: g.samples[0].metadata.get("taken_by_filter") for g in second}
    assert taken == {2: 1, 3: None}
    for rollout_id, groups in ((0, first), (1, second)):
        for position, group in enumerate(groups):
            assert len(group.samples) == 2
            for sample in group.samples:
                assert sample.metadata["rollout_function"] == rollout_id
                assert sample.metadata["data_source"] == "TaggedDataSource"
                assert sample.metadata["loaded_from"] == -1  # slime loads the data source at start: load(start - 1)
                assert sample.tokens[-3:] == [17, 18, 0] and sample.rollout_log_probs == [-0.5, -1.25, -0.125]
                assert sample.weight_versions == ["v7"] and sample.loss_mask == [1, 1, 1]
                # the function's own reward is kept; the others come from the job's reward (len("12") = 2)
                assert sample.reward == (slime_rollout.PRESET_REWARD if position == 0 else 2.0)
    assert len(reward.calls) >= 1
    # the prompt rollout 1 kept for later (4) holds its lease; nothing else is leased or lost
    assert [p.index for p in buffer.leased.values()] == [4] and not buffer.returned
    # save_interval 2: saved after rollout 1, with the one group it keeps
    assert (tmp_path / "ckpt" / "data_source_1.json").read_text() == '{"buffered": 1}'
    assert not (tmp_path / "ckpt" / "data_source_0.json").exists()
    assert statuses[1].metrics["rollout/reward_mean"] == pytest.approx((0.5 * 2 + 2.0 * 2) / 4)
    assert statuses[1].metrics["rollout/function/function_groups"] == 2.0 and not any(
        "note" in key for key in statuses[1].metrics)


def test_slimes_default_data_source_and_pop_first_without_the_paths(tiny_model_dir, tmp_path):
    buffer = FakeBuffer(8)
    statuses, _ = run_two(buffer, config(tiny_model_dir, tmp_path, data_source_path=""), tiny_model_dir)
    assert [s.state for s in statuses] == [RolloutState.DONE] * 2, [s.error for s in statuses]
    # pop_first takes the oldest kept group (prompt 2) first
    assert [g.prompt_index for g in buffer.rollout_groups(1)] == [2, 3]
    assert "data_source" not in buffer.rollout_groups(1)[0].samples[0].metadata


def test_a_kept_group_whose_lease_expired_is_not_generated_twice_when_its_prompt_comes_back(tiny_model_dir, tmp_path):
    """Rollout 0 keeps prompt 2; its lease expires (the buffer serves it again, first); rollout 1 takes the kept
    group through the filter and leases on: the prompt served again renews the kept group's lease, no second group."""
    buffer = FakeBuffer(8)
    cfg = config(tiny_model_dir, tmp_path, buffer_filter_path="tests.plugins.slime_rollout.take_newest")

    async def main():
        manager, _ = new_manager(buffer, Engine(), tiny_model_dir)
        try:
            first = await rollout(manager, cfg, 0)
            expired = [lease for lease, prompt in buffer.leased.items() if prompt.index == 2]
            buffer.returned += [buffer.leased.pop(lease) for lease in expired]  # what the buffer does at expiry
            return first, await rollout(manager, cfg, 1)
        finally:
            await manager.close()

    statuses = asyncio.run(main())
    assert [s.state for s in statuses] == [RolloutState.DONE] * 2, [s.error for s in statuses]
    assert [g.prompt_index for g in buffer.rollout_groups(1)] == [2, 3]
    assert [p.index for p in buffer.leased.values()] == [4] and not buffer.returned


def test_a_trainer_that_resumed_gets_its_data_source_built_and_loaded_again(tiny_model_dir, tmp_path):
    """Rollout 1 asked again after it ran here (the trainer resumed from rollout 0's checkpoint and the buffer's
    restored state lost rollout 1): slime's start, load(start - 1), on a new data source; the old one's kept group
    gives its prompt back."""
    buffer = FakeBuffer(8)
    cfg = config(tiny_model_dir, tmp_path)

    async def main():
        manager, _ = new_manager(buffer, Engine(), tiny_model_dir)
        try:
            for rollout_id in (0, 1):
                await rollout(manager, cfg, rollout_id)
            for group in buffer.rollout_groups(1):
                del buffer.groups[group.group_id]
            del manager.runs[(JOB, 1)]
            return await rollout(manager, cfg, 1)
        finally:
            await manager.close()

    status = asyncio.run(main())
    assert status.state == RolloutState.DONE, status.error
    groups = buffer.rollout_groups(1)
    assert all(s.metadata["loaded_from"] == 0 for g in groups for s in g.samples)
    # prompt 4, kept by the old data source, went back and was leased first; the new one keeps prompt 6
    assert [g.prompt_index for g in groups] == [4, 5] and [p.index for p in buffer.leased.values()] == [6]


@pytest.mark.parametrize(("fn", "message"), [
    ("returns_too_few", "returned 0 groups; the trainer trains on rollout_batch_size (2)"),
    ("returns_made_up_groups", "answers no prompt leased from the buffer"),
])
def test_a_function_that_breaks_the_contract_fails_its_rollout_and_gives_its_leases_back(tiny_model_dir, tmp_path,
                                                                                       fn, message):
    buffer = FakeBuffer(8)

    async def main():
        manager, _ = new_manager(buffer, Engine(), tiny_model_dir)
        try:
            return await rollout(manager, config(tiny_model_dir, tmp_path, data_source_path="",
                                                 rollout_function_path=f"tests.plugins.slime_rollout.{fn}"), 0)
        finally:
            await manager.close()

    status = asyncio.run(main())
    assert status.state == RolloutState.FAILED and message in status.error
    assert not buffer.leased and not buffer.groups and buffer.returned


@pytest.mark.parametrize(("loader", "path", "message"), [
    (rollout_function.load_rollout_function, "tests.plugins.slime_rollout.async_rollout", "must be a plain function"),
    (rollout_function.load_rollout_function, "tests.plugins.slime_rollout.no_evaluation", "no `evaluation` keyword"),
    (rollout_function.load_rollout_function, "tests.plugins.slime_rollout.missing", "has no function 'missing'"),
    (rollout_function.load_rollout_function, "elsewhere.rollout.fn", "not under an allowed plugin module"),
    (rollout_function.load_data_source_class, "tests.plugins.slime_rollout.take_newest", "is not a class"),
    (rollout_function.load_buffer_filter, "tests.plugins.slime_rollout.two_params_filter", "takes 2 positional"),
])
def test_hooks_that_do_not_fit_are_refused_naming_the_setting(loader, path, message):
    with pytest.raises(InvalidArgument, match="^(rollout_function_path|data_source_path|buffer_filter_path): ") as err:
        loader(path)
    assert message in str(err.value)


def test_a_rollout_function_does_not_take_a_fully_async_stream(tiny_model_dir, tmp_path):
    with pytest.raises(InvalidArgument, match="does not take a fully_async stream"):
        config(tiny_model_dir, tmp_path, max_inflight_groups=4)


def test_a_data_source_alone_runs_slimes_default_rollout_with_over_sampling_and_partial_rollout(tiny_model_dir,
                                                                                              tmp_path):
    """No rollout function: slime's generate_rollout over the data source. Each rollout over-samples 3 prompts for
    2 groups; the last prompt's requests are held until the batch is full and aborted with one token generated,
    which partial_rollout gives back to the data source; the next rollout's buffer filter takes it first and its
    samples continue from that token."""
    buffer, held = FakeBuffer(8), {2}
    router = ScriptedRouter(lambda body, headers: None if sample_of(body)[0] in held else reply([17, 18, 0], "12"),
                            on_abort=lambda body: reply([9], "9", finish="abort"))
    cfg = config(tiny_model_dir, tmp_path, rollout_function_path="", over_sampling_batch_size=3,
                 partial_rollout=True, buffer_filter_path="tests.plugins.slime_rollout.take_newest")

    async def main():
        manager, _ = new_manager(buffer, router, tiny_model_dir)
        try:
            first = await rollout(manager, cfg, 0)
            held.clear()
            held.add(4)
            router.aborted.clear()
            return first, await rollout(manager, cfg, 1)
        finally:
            await manager.close()

    statuses = asyncio.run(main())
    assert [s.state for s in statuses] == [RolloutState.DONE] * 2, [s.error for s in statuses]
    assert [g.prompt_index for g in buffer.rollout_groups(0)] == [0, 1]
    second = buffer.rollout_groups(1)
    assert [g.prompt_index for g in second] == [2, 3]
    resumed = second[0].samples
    assert all(s.metadata["taken_by_filter"] == 1 and s.metadata["start_rollout_id"] == 0 for s in resumed)
    assert all(s.tokens[-4:] == [9, 17, 18, 0] and s.response_length == 4 for s in resumed)
    assert all(s.response == "912" and s.reward == 3.0 for s in resumed)  # scored once, whole: len("912")
    assert "taken_by_filter" not in second[1].samples[0].metadata
    # prompt 4 was aborted with a token and is held by the data source with its lease
    assert [p.index for p in buffer.leased.values()] == [4] and not buffer.returned


def test_slimes_default_rollout_drops_filtered_groups_as_the_service_loop_does(tiny_model_dir, tmp_path):
    buffer = FakeBuffer(8)
    cfg = config(tiny_model_dir, tmp_path, rollout_function_path="", over_sampling_batch_size=3,
                 dynamic_sampling_filter_path="tests.plugins.rollout_fns.keep_even_prompts")

    async def main():
        manager, _ = new_manager(buffer, Engine(), tiny_model_dir)
        try:
            return await rollout(manager, cfg, 0)
        finally:
            await manager.close()

    status = asyncio.run(main())
    assert status.state == RolloutState.DONE, status.error
    assert [g.prompt_index for g in buffer.rollout_groups(0)] == [0, 2]
    assert [g.prompt_index for g in buffer.rollout_groups(-1)] == [1]  # used up for the epoch, as in slime
    assert status.metrics["rollout/dynamic_filter/drop_filtered"] == 1.0


def test_args_hold_integers_as_integers_after_the_proto(tiny_model_dir, tmp_path):
    """A Struct carries numbers as doubles; slime's functions do range(args.n_samples_per_prompt)."""
    from services.rollout.client import config_from_proto, config_to_proto

    cfg = config(tiny_model_dir, tmp_path)
    cfg = rollout_config(**{**{k: getattr(cfg, k) for k in ("rollout_batch_size", "rollout_function_path")},
                            "args": {"n_samples_per_prompt": 2, "num_rollout": 3, "lr": 1e-6, "temperature": 1.0,
                                     "colocate": True, "nested": {"k": 1}}})
    args = config_from_proto(config_to_proto(cfg)).args
    assert args == {"n_samples_per_prompt": 2, "num_rollout": 3, "lr": 1e-6, "temperature": 1.0, "colocate": True,
                    "nested": {"k": 1}}
    assert [type(args[k]) for k in ("n_samples_per_prompt", "num_rollout", "temperature", "colocate")] == [
        int, int, float, bool]
