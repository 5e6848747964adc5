"""One feed per mode, chosen once from the job's driver settings, and when each pushes weights to the engines."""

from __future__ import annotations

import pytest

from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.feed import FEEDS, FullyAsyncFeed, OneStepAsyncFeed, RolloutFeed, make_feed
from services.trainer.spec import parse_spec

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
