"""Eviction as Kubernetes does it: SIGTERM to the trainer in the middle of a job. The job checkpoints at its next safe
point (the state after its last train step), the trainer exits 0, and when the trainer starts again the job resumes
from that checkpoint by itself and finishes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from physarum import stack
from services.trainer.api.client import JobsRestClient
from services.trainer.checkpoint import iterations
from tests.e2e.test_loop import job_spec

NUM_ROLLOUT = 6
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def wait_exit(pid: int, timeout_s: float = 120.0) -> int:
    """The exit status of our child `pid` (the stack's processes are this test process's children)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    raise AssertionError(f"trainer (pid {pid}) still runs {timeout_s} s after SIGTERM")


def test_sigterm_checkpoints_at_the_next_safe_point_exits_0_and_the_job_resumes(local_stack, tiny_model_dir,
                                                                                 addition_task, tmp_path):
    train_path, _ = addition_task
    save = tmp_path / "ckpt"
    # save_interval past the job: the only checkpoint before the last rollout is the one SIGTERM asks for
    spec = job_spec(tiny_model_dir, train_path, job_id="evicted", num_rollout=NUM_ROLLOUT, save=str(save),
                    save_interval=100)
    work_dir = Path(local_stack["work_dir"])
    with JobsRestClient(local_stack["trainer_url"], timeout_s=30) as client:
        client.submit(spec)
        deadline = time.monotonic() + 300
        while (job := client.get("evicted"))["rollout_id"] < 1:
            assert job["state"] not in TERMINAL and time.monotonic() < deadline, job
            time.sleep(0.1)
    assert iterations.latest_iteration(save) is None
    [trainer] = [e for e in stack.read_state(work_dir)["processes"] if e["name"] == "trainer"]
    assert stack._owned(trainer)
    os.kill(trainer["pid"], signal.SIGTERM)
    assert wait_exit(trainer["pid"]) == 0
    latest = iterations.latest_iteration(save)
    assert latest is not None and 1 <= latest < NUM_ROLLOUT - 1, latest

    state = stack.restart_trainer(work_dir)
    with JobsRestClient(state["trainer_url"], timeout_s=30) as client:
        deadline = time.monotonic() + 300
        while (job := client.get("evicted"))["state"] not in TERMINAL:
            assert time.monotonic() < deadline, job
            time.sleep(0.5)
        events = client.events("evicted")
    assert job["state"] == "SUCCEEDED", job["error"]
    assert job["attempts"] == 0  # a clean stop, not a crash
    reasons = [t["reason"] for t in job["transitions"]]
    assert reasons[2].startswith("preempted: the trainer stopped") and reasons[3:] == ["running (resumed)", "finished"]
    resumed = next(i for i, e in enumerate(events) if e["message"] == "running (resumed)")
    assert any(f"at rollout {latest + 1}" in e["message"] for e in events[resumed:])
    trained = sorted(e["rollout_id"] for e in events[resumed:] if "train/loss" in e["metrics"])
    assert trained == list(range(latest + 1, NUM_ROLLOUT))
