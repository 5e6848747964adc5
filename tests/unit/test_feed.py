"""One feed per mode, chosen once from the job's driver settings, when each pushes weights to the engines, and the
rollout metrics every rank's share adds up to."""

from __future__ import annotations

import pytest

from services.common.samples import Sample, Status
from services.trainer.api.spec import parse_spec
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.feed import (
    FEEDS,
    FullyAsyncFeed,
    OneStepAsyncFeed,
    RolloutFeed,
    combine_rollout_stats,
    make_feed,
    rollout_sums,
)

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 5, "rollout_batch_size": 4}


@pytest.mark.parametrize(("mode", "cls", "interval", "pushes"), [
    ("sync", RolloutFeed, 1, [0, 1, 2, 3, 4]),
    ("one_step_async", OneStepAsyncFeed, 2, [1, 3, 4]),  # every 2nd rollout and after the last
    ("fully_async", FullyAsyncFeed, 2, [1, 3, 4]),
])
def test_each_mode_gets_its_feed_and_pushes_weights_on_its_schedule(mode, cls, interval, pushes):
    spec = parse_spec({**BASE, "mode": mode, "update_weights_interval": interval})
    feed = make_feed(spec.driver, spec.rollout, TrainerDeps(), ctx=None)
    assert type(feed) is cls and set(FEEDS) == {"sync", "one_step_async", "fully_async"}
    assert [r for r in range(5) if feed.weight_update_due(r)] == pushes


def test_only_the_stream_reports_stale_groups_and_only_one_step_async_waits_before_a_push():
    sync = parse_spec(BASE)
    stream = parse_spec({**BASE, "mode": "fully_async"})
    assert make_feed(sync.driver, sync.rollout, TrainerDeps(), ctx=None).metrics() == {}
    assert make_feed(stream.driver, stream.rollout, TrainerDeps(), ctx=None).metrics() == {
        "buffer/stale_dropped": 0.0, "buffer/stale_regenerated": 0.0}
    last = parse_spec({**BASE, "mode": "one_step_async"})
    waited = make_feed(last.driver, last.rollout, TrainerDeps(), ctx=None).before_weight_update(4)
    assert set(waited) == {"perf/wait_next_rollout_seconds"}  # the last rollout has no next one to wait for
    assert make_feed(sync.driver, sync.rollout, TrainerDeps(), ctx=None).before_weight_update(4) == {}


def test_the_rollout_metrics_of_every_rank_add_up_to_the_whole_rollouts():
    # rank A: rewards 1, 0 from versions 2 and 3; rank B: rewards 1, 1, one from version 4, one of unknown age
    # (no weight_versions), one truncated and one whose reward failed. At trainer version 4: behind 2, 1, 0.
    rank_a = [Sample(reward=1.0, response_length=2, weight_versions=["2"]),
              Sample(reward=0.0, response_length=4, weight_versions=["3"], reward_error="timeout")]
    rank_b = [Sample(reward=1.0, response_length=6, weight_versions=["4"], status=Status.TRUNCATED),
              Sample(reward=1.0, response_length=8)]
    metrics = combine_rollout_stats([rollout_sums(rank_a, 4), rollout_sums(rank_b, 4)])
    assert metrics == pytest.approx({
        "rollout/reward_mean": 0.75, "rollout/reward_std": 0.1875 ** 0.5,  # E[r^2] - E[r]^2 = 0.75 - 0.5625
        "rollout/response_len_mean": 5.0, "rollout/truncated_ratio": 0.25, "rollout/reward_failed_ratio": 0.25,
        "rollout/weight_staleness_max": 2.0, "rollout/weight_staleness_mean": 1.0})
    assert combine_rollout_stats([rollout_sums(rank_a + rank_b, 4)]) == pytest.approx(metrics)
