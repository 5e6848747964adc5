"""End to end: the asynchronous modes on the local stack — one_step_async trains each rollout on samples
one policy version old, fully_async never trains a token more than max_weight_staleness versions old, refuses the
staler groups it has, and every prompt is trained at most once."""

import collections

import redis

from tests.e2e.test_loop import job_spec, run


def trained_groups(state, job_id: str, num_rollout: int, batch: int) -> list[str]:
    """The group ids ("job:epoch:index") each rollout trained on, read from the buffer's Redis."""
    client = redis.Redis.from_url(state["redis_url"], socket_timeout=10)
    try:
        return [gid.decode() for r in range(num_rollout)
                for gid in client.lrange(f"physarum:{{{job_id}}}:rollout:{r}", 0, batch - 1)]
    finally:
        client.close()


def rollout_steps(events) -> dict[int, dict]:
    return {e["rollout_id"]: e["metrics"] for e in events if "train/loss" in e["metrics"]}


def test_one_step_async_trains_on_the_previous_policy(local_stack, tiny_model_dir, addition_task):
    train_path, _ = addition_task
    job, events = run(local_stack, job_spec(tiny_model_dir, train_path, job_id="e2e-one-step", num_rollout=3,
                                            mode="one_step_async"))
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = rollout_steps(events)
    assert sorted(steps) == [0, 1, 2]
    # rollout 0 comes from the initial weights (version 0 = the trainer's); rollout r+1 was generated while
    # rollout r trained, by version r: one behind the trainer's r+1.
    assert [steps[r]["rollout/weight_staleness_max"] for r in range(3)] == [0.0, 1.0, 1.0]
    assert all(steps[r]["perf/engine_pause_seconds"] > 0 for r in range(3))
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # on-policy: engine and trainer agree


def test_fully_async_enforces_the_staleness_bound(local_stack, tiny_model_dir, addition_task):
    """max_inflight_groups of 3 rollouts: the stream generates them with one version, so the third is two versions
    old when its turn comes and is regenerated instead of trained."""
    train_path, _ = addition_task
    num_rollout, batch = 4, 4
    job, events = run(local_stack, job_spec(tiny_model_dir, train_path, job_id="e2e-fully-async",
                                            num_rollout=num_rollout, mode="fully_async", max_weight_staleness=1,
                                            max_inflight_groups=3 * batch))
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = rollout_steps(events)
    assert sorted(steps) == list(range(num_rollout))
    assert max(m["rollout/weight_staleness_max"] for m in steps.values()) <= 1.0
    assert steps[num_rollout - 1]["buffer/stale_regenerated"] > 0
    groups = trained_groups(local_stack, "e2e-fully-async", num_rollout, batch)
    assert len(groups) == num_rollout * batch
    assert [gid for gid, n in collections.Counter(groups).items() if n > 1] == []  # no prompt trained twice
