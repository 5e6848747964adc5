"""End to end on a stack of its own with two trainer ranks (FSDP2 over gloo): the demo job from the CLI, a job
killed with SIGKILL after a checkpoint that resumes by itself on exactly the prompts of a never-stopped job, one
whose worker rank alone is SIGKILLed that resumes when the ranks restart, and
rollouts dumped without training, then replayed through training without engines, and a job whose two ranks split
every sequence (context parallelism). Then the same two ranks as one Megatron CP=2 group running GRPO with slime's
mismatch helper (mis.py), and as one Megatron TP=2 group: the engines get weights converted from Megatron, and a job
resumes from its dist-iterations."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from physarum import stack
from services.common.errors import InvalidArgument
from services.common.sglang import SGLangClient
from services.rollout.client import RolloutClient
from services.trainer.__main__ import RANK_LOST_EXIT
from services.trainer.api.client import JobsRestClient
from services.trainer.checkpoint import iterations
from tests.e2e.roots import stack_roots
from tests.e2e.test_eviction import wait_exit

REPO = Path(__file__).resolve().parents[2]
SLIME_ROOT = REPO / "tests" / "slime_examples"  # slime's examples/ (the mismatch helper's mis.py and mis.yaml)
MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@contextlib.contextmanager
def slime_on_path() -> Iterator[None]:
    """slime's root on the path of the ranks started inside, as its scripts put it (examples.*): at the stack's start
    and at each restart of its ranks, which inherit this process's environment."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(SLIME_ROOT), os.environ.get("PYTHONPATH", "")]))
        yield


@pytest.fixture(scope="module")
def ranks_stack(session_dir, tiny_model_dir):
    work_dir = session_dir / "stack-ranks"
    with slime_on_path():
        state = stack.up(stack.StackOptions(work_dir=work_dir, model_path=tiny_model_dir, num_engines=1,
                                            trainer_threads=1, trainer_ranks=2, path_roots=stack_roots(session_dir)))
    yield state
    stack.down(work_dir)


def job_spec(model_dir, data_path, job_id, **overrides):
    return {"job_id": job_id, "hf_checkpoint": str(model_dir), "prompt_data": str(data_path), "num_rollout": 5,
            "rollout_batch_size": 2, "n_samples_per_prompt": 2, "global_batch_size": 4, "rollout_shuffle": True,
            "rollout_max_response_len": 4, "rm_type": "exact_match", "lr": 1e-4, "weight_sync_timeout_s": 30.0,
            "lease_timeout_s": 20.0, "rollout_timeout_s": 120.0, **overrides}


def wait(client, job_id, timeout_s=180, until=lambda job: job["state"] in TERMINAL):
    deadline = time.monotonic() + timeout_s
    while not until(job := client.get(job_id)):
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']}"
        time.sleep(0.2)
    return job


def run(state, spec):
    with JobsRestClient(state["trainer_url"], timeout_s=30) as client:
        job = wait(client, client.submit(spec)["job_id"])
        return job, client.events(job["job_id"])


def prompt_indices(pattern: str, num_rollout: int) -> list[list[int]]:
    """Per rollout, the prompt (dataset index) of each group it trained on, from its debug dump."""
    return [sorted({s.group_index for s in iterations.load_debug_rollout_data(pattern, r)}) for r in range(num_rollout)]


def test_cli_runs_the_demo_job_on_two_trainer_ranks(ranks_stack, tiny_model_dir, addition_task, tmp_path):
    train_path, _ = addition_task
    overrides = {"train_backend": "fsdp", "hf_checkpoint": tiny_model_dir, "prompt_data": train_path,
                 "num_rollout": 2, "rollout_batch_size": 4, "n_samples_per_prompt": 4, "global_batch_size": 8,
                 "micro_batch_size": 2, "job_id": "demo-fsdp", "save_hf": tmp_path / "hf"}
    cli = [sys.executable, "-m", "physarum", "--work-dir", ranks_stack["work_dir"], "submit",
           str(REPO / "examples" / "demo" / "job.yaml"), "--wait"]
    for key, value in overrides.items():
        cli += ["--set", f"{key}={value}"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "demo-fsdp: SUCCEEDED" in done.stdout
    # rank 0 gathered the sharded weights for the export and for the engines: they hold the same version 2
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    with RolloutClient(ranks_stack["rollout_addr"]) as rollout:
        engines, _ = rollout.list_engines()
    for engine in engines:
        with SGLangClient(engine.url) as client:
            assert client.model_info()["weight_version"] == "2"
            got = client.get_weights_by_name(name, truncate_size=64)
            assert got == pytest.approx(exported[name].flatten()[:64].tolist(), abs=1e-7)
    metrics = httpx.get(f"{ranks_stack['trainer_url']}/metrics", timeout=10).text
    assert "physarum_trainer_train_grad_norm " in metrics and "physarum_trainer_rollouts_total" in metrics


def test_a_job_killed_after_a_checkpoint_resumes_by_itself_on_the_prompts_of_a_never_stopped_job(
        ranks_stack, tiny_model_dir, addition_task, tmp_path):
    """Two jobs submitted, both ranks SIGKILLed in the middle of the first, the trainer started again: with no one
    resubmitting, the first resumes from its latest checkpoint on exactly the prompts of a never-stopped run, the
    second runs after it, and the API shows both with their whole histories."""
    train_path, _ = addition_task
    never_stopped, _ = run(ranks_stack, job_spec(tiny_model_dir, train_path, "never-stopped",
                                                 save_debug_rollout_data=str(tmp_path / "ref" / "{rollout_id}.pt")))
    assert never_stopped["state"] == "SUCCEEDED", never_stopped["error"]

    save = tmp_path / "ckpt"
    spec = job_spec(tiny_model_dir, train_path, "stopped", save=str(save), save_interval=2,
                    save_debug_rollout_data=str(tmp_path / "run" / "{rollout_id}.pt"))
    with JobsRestClient(ranks_stack["trainer_url"], timeout_s=30) as client:
        client.submit(spec)
        client.submit(job_spec(tiny_model_dir, train_path, "queued-behind", num_rollout=2))
        job = wait(client, "stopped", until=lambda job: job["rollout_id"] >= 2 or job["state"] in TERMINAL)
        assert job["state"] == "RUNNING", job
        history = client.events("stopped")
    killed = [e for e in stack.read_state(ranks_stack["work_dir"])["processes"] if e["name"].startswith("trainer")]
    assert len(killed) == 2 and all(stack._owned(e) for e in killed)
    for entry in killed:
        os.kill(entry["pid"], signal.SIGKILL)
    latest = iterations.latest_iteration(save)
    assert latest is not None and latest >= 1

    with slime_on_path():
        stack.restart_trainer(ranks_stack["work_dir"])
    with JobsRestClient(ranks_stack["trainer_url"], timeout_s=30) as client:
        resumed = wait(client, "stopped")
        second = wait(client, "queued-behind")
        events = client.events("stopped")
        second_events = client.events("queued-behind")
    assert resumed["state"] == "SUCCEEDED", resumed["error"]
    assert resumed["attempts"] == 1 and second["state"] == "SUCCEEDED", second["error"]
    assert events[:len(history)] == history  # the history from before the kill, as it was
    reasons = [t["reason"] for t in resumed["transitions"]]
    assert reasons[:2] == ["queued", "running"]
    assert "(restart 1; 0 in a row without progress, at most 3)" in reasons[2]
    assert reasons[3:] == ["running (resumed)", "finished"]
    restarted = next(i for i, e in enumerate(events) if "(restart 1; " in e["message"])
    # a kill between checkpoint `latest` and its report has the resumed job report that rollout's metrics, as kept
    # with the checkpoint: reported, not trained again
    kept = [e["rollout_id"] for e in events[restarted:] if e["message"].endswith("kept with its checkpoint")]
    assert kept in ([], [latest])
    trained = sorted({e["rollout_id"] for e in events[restarted:]
                      if "train/loss" in e["metrics"] and not e["message"].endswith("kept with its checkpoint")})
    assert trained == list(range(latest + 1, 5))
    assert any(f"at rollout {latest + 1}" in e["message"] for e in events)
    # the second job waited for the first: it started only after the first had finished
    first_done = next(e["time"] for e in events if e["state"] == "SUCCEEDED")
    assert next(e["time"] for e in second_events if e["state"] == "RUNNING") >= first_done
    expected = prompt_indices(str(tmp_path / "ref" / "{rollout_id}.pt"), 5)
    assert prompt_indices(str(tmp_path / "run" / "{rollout_id}.pt"), 5) == expected
    assert len({i for rollout in expected for i in rollout}) == 10  # no prompt twice


def test_a_worker_rank_killed_mid_job_stops_rank_0_and_the_job_resumes_when_the_ranks_restart(
        ranks_stack, tiny_model_dir, addition_task, tmp_path):
    """SIGKILL to rank 1 alone in the middle of a job: rank 0's next collective breaks, the job is not FAILED but
    waits to resume, rank 0 exits non-zero; started again as a supervisor would, the ranks resume it from its latest
    checkpoint and it finishes, its history naming the lost rank."""
    train_path, _ = addition_task
    save = tmp_path / "ckpt"
    spec = job_spec(tiny_model_dir, train_path, "worker-killed", num_rollout=4, save=str(save), save_interval=1)
    with JobsRestClient(ranks_stack["trainer_url"], timeout_s=30) as client:
        client.submit(spec)
        job = wait(client, "worker-killed", until=lambda job: job["rollout_id"] >= 1 or job["state"] in TERMINAL)
        assert job["state"] == "RUNNING", job
    entries = {e["name"]: e for e in stack.read_state(ranks_stack["work_dir"])["processes"]}
    rank0, worker = entries["trainer"], entries["trainer-1"]
    assert stack._owned(rank0) and stack._owned(worker)
    os.kill(worker["pid"], signal.SIGKILL)
    assert wait_exit(rank0["pid"], timeout_s=180) == RANK_LOST_EXIT  # it noticed, recorded the job, and left
    latest = iterations.latest_iteration(save)
    assert latest is not None and latest < 3

    with slime_on_path():
        stack.restart_trainer(ranks_stack["work_dir"])
    with JobsRestClient(ranks_stack["trainer_url"], timeout_s=30) as client:
        resumed = wait(client, "worker-killed")
        events = client.events("worker-killed")
    assert resumed["state"] == "SUCCEEDED", resumed["error"]
    assert resumed["attempts"] == 1
    reasons = [t["reason"] for t in resumed["transitions"]]
    assert reasons[:2] == ["queued", "running"] and reasons[3:] == ["running (resumed)", "finished"]
    assert reasons[2].startswith("a trainer rank was lost: a collective between the trainer's ranks broke"), reasons
    assert "(restart 1; " in reasons[2]
    restarted = next(i for i, e in enumerate(events) if e["message"] == "running (resumed)")
    # a kill between checkpoint `latest` and its report has the resumed job report that rollout's metrics, as kept
    # with the checkpoint: reported, not trained again
    kept = [e["rollout_id"] for e in events[restarted:] if e["message"].endswith("kept with its checkpoint")]
    assert kept in ([], [latest])
    trained = sorted({e["rollout_id"] for e in events[restarted:]
                      if "train/loss" in e["metrics"] and not e["message"].endswith("kept with its checkpoint")})
    assert trained == list(range(latest + 1, 4))


def test_rollouts_dumped_without_training_replay_through_training_without_engines(
        ranks_stack, tiny_model_dir, addition_task, tmp_path):
    train_path, _ = addition_task
    pattern = str(tmp_path / "dump" / "{rollout_id}.pt")
    generated, events = run(ranks_stack, job_spec(tiny_model_dir, train_path, "rollout-only", num_rollout=1,
                                                  debug_rollout_only=True, save_debug_rollout_data=pattern))
    assert generated["state"] == "SUCCEEDED", generated["error"]
    metrics = [e["metrics"] for e in events if e["metrics"]]
    assert len(metrics) == 1 and "rollout/reward_mean" in metrics[0] and "train/loss" not in metrics[0]
    samples = iterations.load_debug_rollout_data(pattern, 0)
    assert len(samples) == 4 and all(s.response_length > 0 and s.rollout_log_probs for s in samples)

    replayed, events = run(ranks_stack, job_spec(tiny_model_dir, "unused.jsonl", "train-only", num_rollout=1,
                                                 load_debug_rollout_data=pattern))
    assert replayed["state"] == "SUCCEEDED", replayed["error"]
    (metrics,) = [e["metrics"] for e in events if e["metrics"]]
    assert metrics["rollout/reward_mean"] == pytest.approx(sum(s.reward for s in samples) / 4)
    assert "train/loss" in metrics and "perf/update_weights_seconds" not in metrics  # no engines were involved


def test_a_context_parallel_job_splits_its_sequences_over_the_two_ranks(ranks_stack, tiny_model_dir, addition_task):
    train_path, _ = addition_task
    job, events = run(ranks_stack, job_spec(tiny_model_dir, train_path, "context-parallel", num_rollout=2,
                                            train_backend="fsdp", context_parallel_size=2))
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # the engines sampled with the weights the split forward recomputes log-probs with (version 0, then the push)
    assert all(step["train/train_rollout_logprob_abs_diff"] < 1e-3 for step in steps)
    # a CP group larger than the trainer is refused at submit, naming the trainer's ranks
    with pytest.raises(InvalidArgument, match="context_parallel_size 4 must divide the trainer's 2 ranks"):
        run(ranks_stack, job_spec(tiny_model_dir, train_path, "context-parallel-4", train_backend="fsdp",
                                  context_parallel_size=4))


def test_a_megatron_grpo_job_at_context_parallelism_2_runs_slimes_mismatch_helper(ranks_stack, tiny_model_dir,
                                                                                  addition_task):
    """GRPO on megatron with the two ranks as one CP group, slime's mis.py (unchanged) as the TIS function with its
    mis.yaml's settings: each rank gives it its CP slice of every response, which slime's cp_utils gather."""
    import yaml

    train_path, _ = addition_task
    settings = yaml.safe_load((SLIME_ROOT / "examples" / "train_infer_mismatch_helper" / "mis.yaml").read_text())
    job, events = run(ranks_stack, job_spec(tiny_model_dir, train_path, "megatron-cp2", num_rollout=2,
                                            train_backend="megatron", context_parallel_size=2, use_tis=True,
                                            custom_tis_function_path=MIS, plugin_args=settings))
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # the engines sampled with the weights the split forward recomputes log-probs with
    assert all(step["train/train_rollout_logprob_abs_diff"] < 1e-3 for step in steps)
    assert all(any("is_ratio_mean_final" in key for key in step) for step in steps), sorted(steps[0])


def test_a_megatron_tp2_job_feeds_the_engines_converted_weights_and_resumes_from_its_checkpoint(
        ranks_stack, tiny_model_dir, addition_task, tmp_path):
    train_path, _ = addition_task
    save = tmp_path / "ckpt"
    spec = job_spec(tiny_model_dir, train_path, "megatron-tp2", num_rollout=3, train_backend="megatron",
                    tensor_model_parallel_size=2, use_kl_loss=True, kl_loss_coef=0.01, ref_update_interval=2,
                    save=str(save), save_hf=str(tmp_path / "hf"),
                    megatron={"attention_dropout": 0.0, "hidden_dropout": 0.0, "bucket_size": 1 << 20,
                              "sequence_parallel": True})  # as slime's scripts at TP > 1 run
    job, events = run(ranks_stack, spec)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 3
    # the engines started from the trainer's first push (HF -> Megatron -> HF) and sampled the log-probs that
    # Megatron's TP=2 forward recomputes
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert steps[0]["train/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the reference is the initial policy
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    with RolloutClient(ranks_stack["rollout_addr"]) as rollout:
        engines, _ = rollout.list_engines()
    for engine in engines:
        with SGLangClient(engine.url) as client:
            assert client.model_info()["weight_version"] == "3"
            for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                         "model.embed_tokens.weight"):
                got = client.get_weights_by_name(name, truncate_size=64)
                assert got == pytest.approx(exported[name].flatten()[:64].tolist(), abs=1e-7), name
    assert {"metadata.json", "common.pt", "rng_rank0.pt", "rng_rank1.pt", "trainer_state.json"} <= {
        p.name for p in iterations.iteration_dir(save, 2).iterdir()}  # Megatron-LM's layout: slime's --load reads it
    assert (save / "rollout" / "global_dataset_state_dict_2.pt").is_file()  # slime's data source resumes from it

    # one more rollout from the checkpoint, with its policy as the reference model too (ref_load)
    resumed, events = run(ranks_stack, {**spec, "job_id": "megatron-tp2-resumed", "num_rollout": 4,
                                        "load": str(save), "ref_load": str(save), "save_hf": ""})
    assert resumed["state"] == "SUCCEEDED", resumed["error"]
    trained = [e for e in events if "train/loss" in e["metrics"]]
    assert [e["rollout_id"] for e in trained] == [3]
    assert any("at rollout 3" in e["message"] for e in events)

    # a misspelt Megatron flag is refused at submit, naming it, before any rank starts the job
    with pytest.raises(InvalidArgument, match="megatron.attention_dropuot: not a field"):
        run(ranks_stack, {**spec, "job_id": "megatron-bad-flag", "megatron": {"attention_dropuot": 0.1}})
