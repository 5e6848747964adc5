"""The driver without engines: debug rollout dumps replayed through training, checkpoints on slime's schedule, an
exact resume from one, and the metrics sinks (job events, Prometheus gauges, TensorBoard event files)."""

from __future__ import annotations

import functools
import json
import re
import time

import pytest
from prometheus_client import generate_latest

from services.trainer.api.jobs import JobRegistry, JobState
from services.trainer.api.spec import parse_spec
from services.trainer.checkpoint import iterations
from services.trainer.driver.loop import TrainerDeps, train
from tests.integration.trainer_ranks import make_samples

NUM_ROLLOUTS = 3


@pytest.fixture(scope="module")
def registry():
    registry = JobRegistry(functools.partial(train, deps=TrainerDeps(num_threads=1)))
    yield registry
    registry.close()


@pytest.fixture(scope="module")
def dumps(tiny_model_dir, tmp_path_factory) -> str:
    pattern = str(tmp_path_factory.mktemp("dumps") / "rollout_{rollout_id}.pt")
    for rollout_id in range(NUM_ROLLOUTS):
        samples = make_samples(tiny_model_dir)
        for s in samples if rollout_id % 2 else ():  # odd rollouts reward the other response of each pair
            s.reward = 1.0 - s.reward
        iterations.save_debug_rollout_data(pattern, rollout_id, samples)
    return pattern


def run(registry, spec: dict, timeout_s: float = 120.0):
    job = registry.submit(parse_spec(spec))
    deadline = time.monotonic() + timeout_s
    while not job.state.terminal:
        assert time.monotonic() < deadline, f"job {job.job_id} still {job.state}"
        time.sleep(0.05)
    return job, {e.rollout_id: e.metrics for e in registry.events_after(job.job_id, 0) if e.metrics}


def replay_spec(model_dir, dumps: str, **overrides) -> dict:
    return {"hf_checkpoint": str(model_dir), "prompt_data": "unused.jsonl", "num_rollout": NUM_ROLLOUTS,
            "rollout_batch_size": 4, "n_samples_per_prompt": 2, "global_batch_size": 4, "lr": 1e-3,
            "lr_warmup_iters": 1, "load_debug_rollout_data": dumps, **overrides}


def test_a_dump_replays_through_training_checkpoints_and_resumes_exactly(registry, tiny_model_dir, dumps, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save = tmp_path / "ckpt"
    job, metrics = run(registry, replay_spec(tiny_model_dir, dumps, job_id="replay", save=str(save), save_interval=2))
    assert job.state == JobState.SUCCEEDED, job.error
    assert sorted(metrics) == [0, 1, 2] and all(m["train/grad_norm"] > 0 for m in metrics.values())
    # slime's schedule: every save_interval rollouts, and the last one
    assert iterations.latest_iteration(save) == 2
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    state = json.loads((save / "iter_0000001" / iterations.STATE_FILE).read_text())
    assert state == {"rollout_id": 1, "job_id": "replay", "world_size": 1, "buffer": None}

    events = EventAccumulator(str(save / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(r, pytest.approx(metrics[r]["train/loss"], abs=1e-6)) for r in range(3)]
    exposition = generate_latest().decode()
    gauge = re.search(r"^physarum_trainer_train_loss\{job=\"replay\"\} (\S+)$", exposition, re.MULTILINE)
    assert gauge and float(gauge[1]) == pytest.approx(metrics[2]["train/loss"])
    assert 'physarum_trainer_jobs_finished_total{state="SUCCEEDED"}' in exposition

    # Resumed from the checkpoint after rollout 1, a job trains rollout 2 exactly as the never-stopped one did.
    resumed, resumed_metrics = run(registry, replay_spec(tiny_model_dir, dumps, job_id="replay-resumed",
                                                         load=str(save), ckpt_step=1))
    assert resumed.state == JobState.SUCCEEDED, resumed.error
    assert sorted(resumed_metrics) == [2]
    for key, value in metrics[2].items():
        if key.startswith("train/"):
            assert resumed_metrics[2][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_load_of_an_empty_directory_starts_fresh_and_a_missing_dump_fails_the_job(registry, tiny_model_dir, dumps,
                                                                                   tmp_path):
    job, metrics = run(registry, replay_spec(tiny_model_dir, dumps, num_rollout=1, load=str(tmp_path / "none")))
    assert job.state == JobState.SUCCEEDED and sorted(metrics) == [0]
    job, _ = run(registry, replay_spec(tiny_model_dir, dumps, num_rollout=NUM_ROLLOUTS + 1))
    assert job.state == JobState.FAILED
    assert f"no dump of rollout {NUM_ROLLOUTS}" in job.error


def test_debug_dumps_round_trip(tiny_model_dir, tmp_path):
    samples = make_samples(tiny_model_dir)
    samples[0].metadata = {"source": "x"}
    path = iterations.save_debug_rollout_data(str(tmp_path / "d{rollout_id}.pt"), 7, samples)
    assert path.name == "d7.pt"
    assert iterations.load_debug_rollout_data(str(tmp_path / "d{rollout_id}.pt"), 7) == samples


def test_ref_load_takes_the_reference_from_an_hf_export_or_a_checkpoint(registry, tiny_model_dir, dumps, tmp_path):
    job, _ = run(registry, replay_spec(tiny_model_dir, dumps, num_rollout=2, save=str(tmp_path / "ckpt"),
                                       save_hf=str(tmp_path / "hf"), lr_warmup_iters=0))
    assert job.state == JobState.SUCCEEDED, job.error
    kl = {"num_rollout": 1, "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k3"}
    first_kl = {}
    for name, ref_load in [("none", ""), ("hf", str(tmp_path / "hf")), ("checkpoint", str(tmp_path / "ckpt"))]:
        job, metrics = run(registry, replay_spec(tiny_model_dir, dumps, **kl, ref_load=ref_load))
        assert job.state == JobState.SUCCEEDED, job.error
        first_kl[name] = metrics[0]["train/kl_loss"]
    # the policy starts from hf_checkpoint: KL to itself is 0, to the trained model (either form, the same) is not
    assert first_kl["none"] == 0.0 and first_kl["hf"] > 1e-6
    assert first_kl["checkpoint"] == pytest.approx(first_kl["hf"], rel=1e-5)


def test_a_stopping_trainer_checkpoints_the_last_trained_rollout_and_leaves_the_job_to_resume(
        tiny_model_dir, dumps, tmp_path):
    """SIGTERM's path: the registry stops after rollout 0 was trained and reported; the loop saves rollout 0 at its
    next safe point (no periodic save is due) and the job goes back to the queue, unfinished."""
    holder = {}

    def runner(spec, ctx):
        report = ctx.report

        def report_then_stop(rollout_id, metrics, message=""):
            report(rollout_id, metrics, message)
            if rollout_id == 0 and metrics:
                holder["registry"].stopping.set()  # what close() does on SIGTERM, without waiting here
        ctx.report = report_then_stop
        train(spec, ctx, TrainerDeps(num_threads=1))

    registry = holder["registry"] = JobRegistry(runner)
    save = tmp_path / "ckpt"
    job = registry.submit(parse_spec(replay_spec(tiny_model_dir, dumps, job_id="stopped", save=str(save),
                                                 save_interval=100)))
    deadline = time.monotonic() + 120
    while not job.events[-1].message.startswith("preempted"):
        assert time.monotonic() < deadline and not job.state.terminal, job.events[-1]
        time.sleep(0.05)
    assert job.state == JobState.QUEUED and job.rollout_id == 0
    assert iterations.latest_iteration(save) == 0
    state = json.loads((iterations.iteration_dir(save, 0) / iterations.STATE_FILE).read_text())
    assert state["rollout_id"] == 0 and state["job_id"] == "stopped"
    registry.close()
