"""End to end: a two-rollout job succeeds through the REST API for every advantage estimator."""

import math

import pytest

from tests.e2e.test_loop import job_spec, run

ESTIMATORS = {
    "grpo": {},
    "gspo": {},
    "cispo": {"eps_clip": 1.0, "eps_clip_high": 4.0},
    "ppo": {"kl_coef": 0.01, "gamma": 0.99, "lambd": 0.95},
    "reinforce_plus_plus": {"normalize_advantages": True},
    "reinforce_plus_plus_baseline": {"normalize_advantages": True},
}


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_job_succeeds_with_each_estimator(local_stack, tiny_model_dir, addition_task, estimator):
    train_path, _ = addition_task
    spec = job_spec(tiny_model_dir, train_path, job_id=f"e2e-estimator-{estimator.replace('_', '-')}", num_rollout=2,
                    rollout_batch_size=4, n_samples_per_prompt=4, rollout_max_response_len=4, global_batch_size=None,
                    micro_batch_size=8, advantage_estimator=estimator, **ESTIMATORS[estimator])
    job, events = run(local_stack, spec)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "rollout/reward_mean" in e["metrics"]]
    assert len(steps) == 2
    for metrics in steps:
        assert math.isfinite(metrics["train/loss"]) and metrics["train/lr"] > 0
        if estimator == "ppo":
            assert math.isfinite(metrics["train/value_loss"]) and "train/critic_grad_norm" in metrics
