"""Checkpoint bookkeeping: slime's save schedule, the latest-iteration file, and the job-spec keys for them."""

import pytest

from services.common.errors import InvalidArgument
from services.trainer.api.spec import parse_spec
from services.trainer.checkpoint import iterations
from services.trainer.driver import intervals
from services.trainer.driver.metrics import prometheus_name

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 5, "rollout_batch_size": 2}


def test_periodic_actions_follow_slime():
    def fired(interval, per_epoch=None):
        return [r for r in range(10) if intervals.should_run_periodic_action(r, interval, per_epoch, 10)]

    assert fired(3) == [2, 5, 8, 9]  # every 3 rollouts and the last
    assert fired(4, per_epoch=3) == [2, 3, 5, 7, 8, 9]  # and at each epoch's end
    assert fired(None) == []


def test_latest_iteration(tmp_path):
    assert iterations.latest_iteration(tmp_path) is None
    (tmp_path / iterations.LATEST_FILE).write_text("12\n")
    assert iterations.latest_iteration(tmp_path) == 12
    assert iterations.iteration_dir(tmp_path, 12) == tmp_path / "iter_0000012"
    (tmp_path / iterations.LATEST_FILE).write_text("release")
    with pytest.raises(InvalidArgument, match="expected a rollout id, got 'release'"):
        iterations.latest_iteration(tmp_path)


def test_checkpoint_and_debug_keys_are_validated():
    spec = parse_spec({**BASE, "save": "/c", "save_interval": 2, "load_debug_rollout_data": "/d/{rollout_id}.pt"})
    assert spec.train_only and spec.save_interval == 2
    for extra, message in [
        ({"save_interval": 2}, "save_interval is set but save"),
        ({"save": "/c", "save_interval": 0}, "save_interval must be > 0"),
        ({"ckpt_step": 3}, "ckpt_step .3. needs load"),
        ({"ref_load": "/r"}, "ref_load and ref_update_interval need a reference model"),
        ({"debug_train_only": True}, "debug_train_only needs load_debug_rollout_data"),
        ({"debug_rollout_only": True, "load_debug_rollout_data": "/d"}, "debug_rollout_only excludes"),
        ({"save_debug_rollout_data": "/d/{step}.pt"}, "bad pattern '/d/{step}.pt'"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            parse_spec({**BASE, **extra})


def test_prometheus_names():
    assert prometheus_name("train/pg_loss") == "physarum_trainer_train_pg_loss"
    assert prometheus_name("perf/update_weights_seconds") == "physarum_trainer_perf_update_weights_seconds"
    assert prometheus_name("rollout/pass@k") == "physarum_trainer_rollout_pass_k"
