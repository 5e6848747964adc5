"""W&B logging in offline mode (no network): one run per job, slime's metric names and step metrics, the key kept
out of the logged config, beside the TensorBoard files."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.trainer.api.spec import parse_spec
from services.trainer.driver import wandb_log
from services.trainer.driver.metrics import MetricsWriter

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 2, "rollout_batch_size": 1,
        "job_id": "wandb-job"}


def test_no_run_without_use_wandb():
    spec = parse_spec(BASE)
    assert wandb_log.start(spec.driver, spec.rollout.args) is None


def test_offline_run_logs_slimes_metric_names(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = parse_spec({**BASE, "use_wandb": True, "wandb_mode": "offline", "wandb_project": "p",
                       "wandb_group": "g", "wandb_dir": str(tmp_path / "wandb"), "wandb_key": "secret-key",
                       "disable_wandb_random_suffix": True})
    run = wandb_log.start(spec.driver, spec.rollout.args)
    writer = MetricsWriter(tmp_path / "tb", run)
    writer.write(0, {"rollout/raw_reward": 0.25, "train/loss": 1.5, "eval/aime": 0.1})
    writer.write(1, {"rollout/raw_reward": 0.5, "train/loss": 1.25})
    summary = dict(run.run.summary)
    assert (summary["rollout/raw_reward"], summary["train/loss"], summary["eval/aime"]) == (0.5, 1.25, 0.1)
    assert (summary["rollout/step"], summary["train/step"], summary["eval/step"]) == (1, 1, 0)
    assert (run.run.name, run.run.group, run.run.project) == ("g", "g", "p")
    assert run.run.config["job_id"] == "wandb-job" and "wandb_key" not in run.run.config
    writer.close()
    wandb.teardown()
    assert len(list((tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb"))) == 1  # written offline
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # beside the TensorBoard files


def test_use_wandb_without_the_package_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(InvalidArgument, match=r"pip install 'physarum\[trainer\]'"):
        spec = parse_spec({**BASE, "use_wandb": True, "wandb_mode": "offline"})
        wandb_log.start(spec.driver, spec.rollout.args)
