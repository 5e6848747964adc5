"""End to end: jobs through the REST API drive rollout, reward, buffer, training and the weight broadcast."""

import json
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from safetensors.torch import load_file

from services.common.sglang import SGLangClient
from services.rollout.client import RolloutClient
from services.trainer.api.client import JobsRestClient


def job_spec(model_dir, data_path, **overrides):
    spec = {"hf_checkpoint": str(model_dir), "prompt_data": str(data_path), "num_rollout": 2,
            "rollout_batch_size": 4, "n_samples_per_prompt": 4, "global_batch_size": 8,
            "rollout_max_response_len": 4, "rm_type": "exact_match", "lr": 1e-4, "rollout_temperature": 1.0,
            "weight_sync_timeout_s": 30.0, "lease_timeout_s": 20.0, "rollout_timeout_s": 300.0}
    spec.update(overrides)
    return spec


def run(state, spec, timeout_s=300):
    with JobsRestClient(state["trainer_url"], timeout_s=30) as client:
        job = client.submit(spec)
        deadline = time.monotonic() + timeout_s
        while (job := client.get(job["job_id"]))["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            assert time.monotonic() < deadline, f"job {job['job_id']} still {job['state']}"
            time.sleep(0.5)
        return job, client.events(job["job_id"])


def engine_urls(state):
    with RolloutClient(state["rollout_addr"]) as rollout:
        engines, _ = rollout.list_engines()
    return [e.url for e in engines]


def test_grpo_job_trains_and_engines_end_with_the_trainers_weights(local_stack, tiny_model_dir, addition_task,
                                                                  tmp_path):
    train_path, _ = addition_task
    job, events = run(local_stack, job_spec(tiny_model_dir, train_path, job_id="e2e-grpo",
                                            save_hf=str(tmp_path / "final")))
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # Engines got the trainer's weights before rollout 0, so the log-probs they returned (through the buffer)
    # must equal the trainer's own recomputation: tokens and log-probs arrived intact and aligned.
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert all(0.0 <= m["rollout/reward_mean"] <= 1.0 for m in steps)
    final = load_file(tmp_path / "final" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    for url in engine_urls(local_stack):
        with SGLangClient(url) as engine:
            assert engine.model_info()["weight_version"] == "2"
            got = engine.get_weights_by_name(name, truncate_size=64)
            want = final[name].flatten()[:64].tolist()
            assert got == pytest.approx(want, abs=1e-7)


def test_sft_job_runs_through_the_same_loop(local_stack, tiny_model_dir, addition_task):
    train_path, _ = addition_task
    job, events = run(local_stack, job_spec(tiny_model_dir, train_path, job_id="e2e-sft", loss_type="sft_loss",
                                            n_samples_per_prompt=1, global_batch_size=4, lr=1e-3))
    assert job["state"] == "SUCCEEDED", job["error"]
    losses = [e["metrics"]["train/loss"] for e in events if "train/loss" in e["metrics"]]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


def test_bad_rows_and_a_raising_reward_function_do_not_stop_the_job(local_stack, tiny_model_dir, addition_task,
                                                                    tmp_path):
    train_path, _ = addition_task
    data = tmp_path / "with-bad-rows.jsonl"
    data.write_text(train_path.read_text() + "{not json\n" + json.dumps({"question": "1+1="}) + "\n")
    spec = job_spec(tiny_model_dir, data, job_id="e2e-bad", num_rollout=1,
                    custom_rm_path="tests.plugins.reward_fns.boom")
    job, events = run(local_stack, spec)
    assert job["state"] == "SUCCEEDED", job["error"]
    assert any("2 rows skipped" in e["message"] for e in events)
    metrics = [e["metrics"] for e in events if "rollout/reward_failed_ratio" in e["metrics"]]
    assert metrics[0]["rollout/reward_failed_ratio"] == 1.0
    assert httpx.get(f"{local_stack['reward_url']}/healthz", timeout=5).status_code == 200


def test_cli_submit_wait_and_malformed_spec(local_stack, tiny_model_dir, addition_task, tmp_path):
    train_path, _ = addition_task
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_spec(tiny_model_dir, train_path, job_id="e2e-cli")))
    cli = [sys.executable, "-m", "physarum", "submit", str(job_file), "--url", local_stack["trainer_url"]]
    bad = subprocess.run([*cli, "--set", "rollout_batchsize=2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "did you mean 'rollout_batch_size'" in bad.stderr
    ok = subprocess.run([*cli, "--set", "num_rollout=1", "--wait"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "e2e-cli: SUCCEEDED" in ok.stdout
