"""The trainer's gauges carry the job they describe, one job's series at a time."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.trainer.driver.metrics import MetricsWriter


def value(name: str, job: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"job": job})


def test_gauges_are_labelled_with_the_job_and_a_new_job_replaces_the_old_series():
    first = MetricsWriter(job_id="job-a")
    first.write(3, {"train/pg_loss": 0.5})
    assert value("physarum_trainer_train_pg_loss", "job-a") == 0.5
    assert value("physarum_trainer_rollout_id", "job-a") == 3
    MetricsWriter(job_id="job-b").write(0, {"train/pg_loss": 0.25})
    assert value("physarum_trainer_train_pg_loss", "job-b") == 0.25
    assert value("physarum_trainer_train_pg_loss", "job-a") is None  # no stale series of a finished job
    assert value("physarum_trainer_rollout_id", "job-a") is None
