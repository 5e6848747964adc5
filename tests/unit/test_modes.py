"""The modes as drivers: each mode's function chosen once from the job's driver settings, when each pushes weights to
the engines, what each does around training (the next rollout started and waited for, the stream's stale counts and
its end), and the rollout metrics every rank's share adds up to."""

from __future__ import annotations

import pytest

from services.common.samples import Sample, Status
from services.common.shares import Share
from services.trainer.api.spec import parse_spec
from services.trainer.distributed.parallel import World
from services.trainer.driver.job_run import weight_update_due
from services.trainer.driver.loop import MODES, fully_async, one_step_async, sync
from services.trainer.driver.rollouts import combine_rollout_stats, rollout_sums

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 5, "rollout_batch_size": 4}


@pytest.mark.parametrize(("mode", "fn", "interval", "pushes"), [
    ("sync", sync, 1, [0, 1, 2, 3, 4]),
    ("one_step_async", one_step_async, 2, [1, 3, 4]),  # every 2nd rollout and after the last
    ("fully_async", fully_async, 2, [1, 3, 4]),
])
def test_each_mode_gets_its_driver_and_pushes_weights_on_its_schedule(mode, fn, interval, pushes):
    spec = parse_spec({**BASE, "mode": mode, "update_weights_interval": interval})
    assert MODES[spec.driver.mode] is fn and set(MODES) == {"sync", "one_step_async", "fully_async"}
    assert [r for r in range(5) if weight_update_due(spec.driver, r)] == pushes


class RecordedRollouts:
    """The rollouts' rank-0 side, recording what the mode asks of it (no manager, no buffer)."""

    def __init__(self, calls: list) -> None:
        self.calls, self.share = calls, Share()
        self.stale = {"buffer/stale_dropped": 1.0, "buffer/stale_regenerated": 2.0}

    def collect(self, rollout_id, share):
        self.calls.append(("collect", rollout_id))
        return [rollout_id]

    def take(self, rollout_id, share):
        self.calls.append(("take", rollout_id))
        return [rollout_id]

    def start(self, rollout_id):
        self.calls.append(("start", rollout_id))

    def stop_stream(self):
        self.calls.append(("stop_stream",))


class RecordedRun:
    """A JobRun that records the steps a mode takes, in order, on one rank."""

    def __init__(self, spec) -> None:
        self.driver, self.world, self.calls = spec.driver, World(), []
        self.rollouts = RecordedRollouts(self.calls)

    def samples(self, rollout_id, groups):
        got = groups(Share())
        self.calls.append(("samples", rollout_id, got))
        return got

    def train(self, rollout_id, samples):
        self.calls.append(("train", rollout_id))
        return {}

    def save_if_due(self, rollout_id, metrics):
        return {}

    def push_weights(self, rollout_id):
        self.calls.append(("push", rollout_id))
        return {}

    def manager_metrics(self, rollout_id):
        return {}

    def evaluate_if_due(self, rollout_id):
        self.calls.append(("eval", rollout_id))
        return {}

    def report(self, rollout_id, metrics):
        self.calls.append(("report", rollout_id, metrics))


def run_mode(mode: str, start_id: int = 0) -> list:
    spec = parse_spec({**BASE, "num_rollout": 3, "mode": mode, "update_weights_interval": 2})
    run = RecordedRun(spec)
    MODES[mode](run, start_id)
    return run.calls


def test_sync_collects_each_rollout_then_trains_pushes_and_evaluates():
    calls = run_mode("sync")
    assert calls[:6] == [("collect", 0), ("samples", 0, [0]), ("train", 0), ("push", 0), ("eval", 0),
                         ("report", 0, {})]
    assert [c[1] for c in calls if c[0] == "push"] == [0, 1, 2]
    assert not any(c[0] in ("start", "take", "stop_stream") for c in calls)


def test_one_step_async_starts_the_next_rollout_before_training_and_waits_for_it_before_a_push():
    calls = run_mode("one_step_async")
    # rollout 0: collected, rollout 1 started before rollout 0 trains; no push after rollout 0 (interval 2)
    assert calls[:4] == [("collect", 0), ("samples", 0, [0]), ("start", 1), ("train", 0)]
    # rollout 1 trains; before its push rollout 2 is waited for (collected), and then served from what was waited for
    one = calls.index(("train", 1))
    assert calls[one + 1:one + 3] == [("collect", 2), ("push", 1)]
    assert ("samples", 2, [2]) in calls and calls.count(("collect", 2)) == 1
    # after the last rollout the weights go out with no next rollout to wait for
    assert calls[calls.index(("train", 2)) + 1] == ("push", 2)
    assert not any(c[0] in ("take", "stop_stream") for c in calls)
    # only one_step_async waits before a push, and reports it (the last rollout too: it had no next one to wait for)
    assert [set(c[2]) for c in calls if c[0] == "report"] == [set(), *[{"perf/wait_next_rollout_seconds"}] * 2]
    assert all(c[2] == {} for c in run_mode("sync") if c[0] == "report")


def test_only_the_stream_takes_reports_stale_groups_and_is_stopped_at_the_end():
    calls = run_mode("fully_async")
    assert [c[1] for c in calls if c[0] == "take"] == [0, 1, 2] and calls[-1] == ("stop_stream",)
    assert [c[2] for c in calls if c[0] == "report"] == [
        {"buffer/stale_dropped": 1.0, "buffer/stale_regenerated": 2.0}] * 3
    for mode in ("sync", "one_step_async"):
        assert not any(key.startswith("buffer/") for c in run_mode(mode) if c[0] == "report" for key in c[2])


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
