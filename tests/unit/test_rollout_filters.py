"""Dynamic sampling filters: slime's built-ins, its keep/drop rule, and the contract (DynamicFilterOutput or bool)."""

from __future__ import annotations

import types

import pytest

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.rollout.generation import filters
from services.rollout.generation.filters import DynamicFilterOutput


def group(*rewards: float) -> list[Sample]:
    return [Sample(reward=r, index=i) for i, r in enumerate(rewards)]


def test_nonzero_std_keeps_groups_whose_rewards_differ():
    assert filters.check_reward_nonzero_std(None, group(1.0, 0.0, 1.0)) == DynamicFilterOutput(keep=True)
    assert filters.check_reward_nonzero_std(None, group(0.04, 0.04)) == DynamicFilterOutput(False, "zero_std_0.0")
    assert filters.check_reward_nonzero_std(None, group(1.0, 1.0, 1.0)) == DynamicFilterOutput(False, "zero_std_1.0")
    assert filters.check_reward_nonzero_std(None, group(-1.0, -1.0)).reason == "zero_std_-1.0"
    assert not filters.check_reward_nonzero_std(None, group(1.0)).keep  # one sample: std 0
    assert filters.check_reward_nonzero_std(None, group(0.0, 2e-6)).keep  # std 1.41e-6 > 1e-6
    assert not filters.check_reward_nonzero_std(None, group(0.0, 1e-6)).keep  # std 7.1e-7


def test_fallback_variant_marks_drops_keepable_when_the_batch_would_be_short():
    assert filters.check_reward_nonzero_std_with_fallback(None, group(1.0, 1.0)) == DynamicFilterOutput(
        keep=False, reason="zero_std_1.0", keep_when_insufficient=True)
    assert filters.check_reward_nonzero_std_with_fallback(None, group(1.0, 0.0)).keep


@pytest.mark.parametrize(("output", "num_remaining", "target", "dropped"), [
    (DynamicFilterOutput(keep=True), 9, 2, False),
    (DynamicFilterOutput(keep=False), 1, 2, True),  # a plain drop is a drop even when the batch runs short
    (DynamicFilterOutput(keep=False, keep_when_insufficient=True), 2, 2, False),  # dropping it leaves 1 < 2
    (DynamicFilterOutput(keep=False, keep_when_insufficient=True), 3, 2, True),  # 2 others can still fill it
])
def test_should_drop_follows_slime(output, num_remaining, target, dropped):
    assert filters.should_drop(output, num_remaining=num_remaining, target=target) is dropped


def test_call_filter_accepts_bools_and_slime_shaped_outputs():
    assert filters.call_filter(lambda args, samples: True, None, []) == DynamicFilterOutput(keep=True)
    assert filters.call_filter(lambda args, samples: 0, None, []) == DynamicFilterOutput(keep=False)
    slime_like = types.SimpleNamespace(keep=1, reason="zero_std_0.0", keep_when_insufficient=True)
    assert filters.call_filter(lambda args, samples: slime_like, None, []) == DynamicFilterOutput(
        keep=True, reason="zero_std_0.0", keep_when_insufficient=True)
    seen = []
    filters.call_filter(lambda args, samples: seen.append((args, samples)) or True, "args", group(1.0))
    assert seen == [("args", group(1.0))]
    with pytest.raises(InvalidArgument, match="returned None"):
        filters.call_filter(lambda args, samples: None, None, [])


def test_load_filter_by_builtin_name_slime_path_or_import_path():
    builtin = filters.check_reward_nonzero_std
    assert filters.load_filter("check_reward_nonzero_std") is builtin
    assert filters.load_filter("slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std") is builtin
    assert filters.load_filter("services.rollout.generation.filters.check_reward_nonzero_std_with_fallback") is \
        filters.check_reward_nonzero_std_with_fallback
    from tests.plugins.rollout_fns import keep_even_prompts

    assert filters.load_filter("tests.plugins.rollout_fns.keep_even_prompts") is keep_even_prompts
    with pytest.raises(InvalidArgument, match="dynamic_sampling_filter_path: .* has no function 'nope'"):
        filters.load_filter("tests.plugins.rollout_fns.nope")


def test_drop_metric_names():
    assert filters.drop_metric("zero_std_1.0") == "rollout/dynamic_filter/drop_zero_std_1.0"
    assert filters.drop_metric(None) == "rollout/dynamic_filter/drop_filtered"
