"""End to end: a job submitted with slime's `--rollout-function-path`, `--data-source-path` and
`--buffer-filter-path` (tests/plugins/slime_rollout.py, slime's imports only) trains: the rollout service runs the
user's function against the buffer-backed data source, and the trainer trains on its groups."""

import httpx

from tests.e2e.test_loop import job_spec, run
from tests.plugins.slime_rollout import PRESET_REWARD

HOOKS = "tests.plugins.slime_rollout"


def test_a_job_with_slimes_rollout_function_data_source_and_buffer_filter_trains(local_stack, tiny_model_dir,
                                                                                 addition_task):
    train_path, _ = addition_task
    spec = job_spec(tiny_model_dir, train_path, job_id="e2e-slime-rollout-fn", train_backend="fsdp",
                    slime_args=f"--rollout-function-path {HOOKS}.generate_rollout --data-source-path "
                               f"{HOOKS}.TaggedDataSource --buffer-filter-path {HOOKS}.take_newest")
    job, events = run(local_stack, spec)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # the log-probs the function's generate calls kept reached the trainer aligned with its own recomputation
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    metrics = [e["metrics"] for e in events if "rollout/function/function_groups" in e["metrics"]]
    assert [m["rollout/function/function_groups"] for m in metrics] == [4.0, 4.0]  # the function's own, logged
    # rollout 1 trained on the group rollout 0 gave back (prompt 4, the filter took it first; the function set its
    # reward) and prompts 5-7 (exact_match rewards)
    board = httpx.get(f"{local_stack['trainer_url']}/v1/dashboard/jobs/{job['job_id']}/samples", timeout=30).json()
    assert board["rollout_id"] == 1 and board["num_samples"] == 16
    rewards = {}
    for sample in board["samples"]:
        rewards.setdefault(sample["group_index"], []).append(sample["reward"])
    assert sorted(rewards) == [4, 5, 6, 7]
    assert rewards[4] == [PRESET_REWARD] * 4
    assert all(r in (0.0, 1.0) for index in (5, 6, 7) for r in rewards[index])
