"""A rollout's metrics travel with the checkpoint that covers it: a trainer killed after saving checkpoint k but
before reporting rollout k's metrics reports them when the job resumes from k; when they were reported, resuming
does not report them twice."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from services.trainer.api.jobs import CHECKPOINT_METRIC, JobRegistry
from services.trainer.api.spec import parse_spec
from services.trainer.checkpoint import iterations
from services.trainer.driver.rollouts import Rollouts

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 4, "rollout_batch_size": 1}
SAVED = {"rollout/reward_mean": 0.75, "train/loss": 0.5, CHECKPOINT_METRIC: 0.0}


def resume(job_id: str, reported_before_kill: bool, root) -> object:
    """Run a job whose runner reports rollout 0, (maybe) rollout 1, then resumes as the loop does from checkpoint 1
    (its metrics file as save_checkpoint writes it); the job's record."""
    iterations.iteration_dir(root, 1).mkdir(parents=True)
    (iterations.iteration_dir(root, 1) / iterations.METRICS_FILE).write_text(json.dumps(SAVED))

    def runner(spec, ctx):
        ctx.report(0, {"rollout/reward_mean": 0.25})
        if reported_before_kill:
            ctx.report(1, SAVED)
        rollouts = SimpleNamespace(driver=SimpleNamespace(engines=False, load="/ckpt"), ctx=ctx)
        Rollouts.resumed(rollouts, 2, None, iterations.saved_metrics(root, 1))

    registry = JobRegistry(runner)
    registry.submit(parse_spec({**BASE, "job_id": job_id}))
    deadline = time.monotonic() + 10
    while not registry.get(job_id).state.terminal and time.monotonic() < deadline:
        time.sleep(0.01)
    job = registry.get(job_id)
    registry.close()
    return job


def test_metrics_lost_to_a_kill_are_reported_from_the_checkpoint_on_resume(tmp_path):
    job = resume("killed", reported_before_kill=False, root=tmp_path)
    reported = [e.metrics for e in job.events if e.rollout_id == 1 and e.metrics]
    assert reported == [SAVED]
    assert job.checkpoints == [1]


def test_metrics_reported_before_the_kill_are_not_reported_twice(tmp_path):
    job = resume("reported", reported_before_kill=True, root=tmp_path)
    assert iterations.saved_metrics(tmp_path, 0) is None
    assert [e.metrics for e in job.events if e.rollout_id == 1 and e.metrics] == [SAVED]
