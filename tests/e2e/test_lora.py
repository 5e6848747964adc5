"""End to end: a LoRA job trains adapters through the local stack; the pool's engines are relaunched serving LoRA,
each sync pushes the adapter alone, the rollouts are sampled with it (lora_path: the job's id), and the engines end
serving the adapter over the untouched base model, their output equal to the merged model the trainer exports.
Two lora_share_pool jobs run at once on the stack's one trainer and one pool, their samples never mixed."""

import json
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from services.buffer.client import BufferClient
from services.common.sglang import SGLangClient
from services.trainer.api.client import JobsRestClient
from tests.e2e.test_loop import engine_urls, job_spec, run

PROMPT = [5, 6, 7, 8, 9]


@torch.no_grad()
def greedy(model_dir, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(num_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


def test_lora_job_syncs_only_its_adapter_and_the_engines_serve_it(local_stack, tiny_model_dir, addition_task,
                                                                  tmp_path):
    train_path, _ = addition_task
    spec = job_spec(tiny_model_dir, train_path, job_id="e2e-lora", lr=1e-2, lora_rank=4, lora_alpha=8.0,
                    target_modules=["q_proj", "v_proj", "down_proj"], use_kl_loss=True, kl_loss_coef=0.01,
                    lora_save_merged=True, save_hf=str(tmp_path / "final"))
    job, events = run(local_stack, spec)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # each rollout was sampled from the policy the trainer recomputes: rollout 1 from the adapter of step 0
    assert all(m["train/train_rollout_logprob_abs_diff"] < 1e-3 for m in steps)
    assert json.loads((tmp_path / "final" / "adapter_config.json").read_text())["r"] == 4
    adapter_bytes = (tmp_path / "final" / "adapter_model.safetensors").stat().st_size
    assert all(m["perf/update_weights_bytes"] <= adapter_bytes for m in steps if "perf/update_weights_bytes" in m)
    merged = load_file(tmp_path / "final" / "merged" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert (merged[name] - base[name]).abs().max() > 1e-4  # the adapter moved the targeted layer
    tokens, logprobs = greedy(tmp_path / "final" / "merged", PROMPT, 4)
    for url in engine_urls(local_stack):
        with SGLangClient(url) as engine:
            assert engine.server_info()["enable_lora"] is True
            assert engine.model_info()["weight_version"] == "2"
            # the base weights stay as loaded: only the adapter was synced
            got = engine.get_weights_by_name(name, truncate_size=64)
            assert got == pytest.approx(base[name].flatten()[:64].tolist(), abs=0)
        reply = httpx.post(f"{url}/generate", json={
            "input_ids": PROMPT, "lora_path": "e2e-lora", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}, timeout=60).json()
        assert reply["output_ids"] == tokens and reply["meta_info"]["weight_version"] == "2"
        assert [e[0] for e in reply["meta_info"]["output_token_logprobs"]] == pytest.approx(logprobs, abs=1e-4)


def test_a_lora_job_over_the_disk_route_moves_its_requests_to_each_version(local_stack, tiny_model_dir, addition_task,
                                                                           tmp_path):
    """lora_sync disk, SGLang's route, on the CPU engines: each version a PEFT directory in the pool's snapshot,
    loaded by /load_lora_adapter as e2e-lora-disk@v<version>; the manager's requests name the version the engines
    hold (the rollouts' log-probs are the trainer's), older versions are unloaded."""
    train_path, _ = addition_task
    spec = job_spec(tiny_model_dir, train_path, job_id="e2e-lora-disk", lr=1e-2, lora_rank=4, lora_alpha=8.0,
                    target_modules=["q_proj", "v_proj", "down_proj"], lora_sync="disk", lora_save_merged=True,
                    save_hf=str(tmp_path / "final"))
    job, events = run(local_stack, spec)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # rollout 1 came from version 1's adapter (e2e-lora-disk@v1), not version 0's nor the base model
    assert all(m["train/train_rollout_logprob_abs_diff"] < 1e-3 for m in steps)
    assert all(m["perf/engine_pause_seconds"] == 0.0 for m in steps if "perf/engine_pause_seconds" in m)
    tokens, logprobs = greedy(tmp_path / "final" / "merged", PROMPT, 4)
    for url in engine_urls(local_stack):
        with SGLangClient(url) as engine:
            assert engine.model_info()["weight_version"] == "2"  # what the pool's health checks compare
        body = {"input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        reply = httpx.post(f"{url}/generate", json={**body, "lora_path": "e2e-lora-disk@v2"}, timeout=60).json()
        assert reply["output_ids"] == tokens
        assert [e[0] for e in reply["meta_info"]["output_token_logprobs"]] == pytest.approx(logprobs, abs=1e-4)
        assert httpx.post(f"{url}/generate", json={**body, "lora_path": "e2e-lora-disk@v1"},
                          timeout=60).status_code == 200  # kept for requests still naming it
        gone = httpx.post(f"{url}/generate", json={**body, "lora_path": "e2e-lora-disk@v0"}, timeout=60)
        assert gone.status_code == 400 and "names no loaded LoRA adapter" in gone.text


def test_two_lora_jobs_share_the_trainer_and_the_pool_at_once_and_their_samples_never_mix(local_stack, tiny_model_dir,
                                                                                          addition_task, tmp_path):
    """Two LoRA jobs of one base (lora_share_pool) run at the same time: both SUCCEED, their runs overlap, every
    sample of each was generated with its own adapter at its own versions, and the trainer's recomputed log-probs
    (each job's own adapter) match the engines' on every rollout, which a sample generated with the other job's
    adapter would break once the two adapters differ (after rollout 0)."""
    train_path, _ = addition_task
    # b's rollouts are half as large, so the jobs' versions drift apart: each must wait for, and record, its own
    specs = [job_spec(tiny_model_dir, train_path, job_id=job_id, lr=lr, lora_rank=4, lora_alpha=8.0,
                      target_modules=["q_proj", "v_proj", "down_proj"], lora_share_pool=True, num_rollout=3,
                      n_samples_per_prompt=n, entropy_coef=0.1, save_hf=str(tmp_path / job_id))
             for job_id, lr, n in (("e2e-lora-a", 5e-2, 4), ("e2e-lora-b", 1e-2, 2))]  # entropy: steps at reward 0
    with JobsRestClient(local_stack["trainer_url"], timeout_s=30) as client:
        ids = [client.submit(spec)["job_id"] for spec in specs]
        deadline = time.monotonic() + 600
        while not all((jobs := {i: client.get(i) for i in ids})[i]["state"] in ("SUCCEEDED", "FAILED", "CANCELLED")
                      for i in ids):
            assert time.monotonic() < deadline, f"jobs still running: {[j['state'] for j in jobs.values()]}"
            time.sleep(0.5)
        events = {i: client.events(i) for i in ids}
    assert all(job["state"] == "SUCCEEDED" for job in jobs.values()), [job["error"] for job in jobs.values()]
    spans = {}
    for i, job in jobs.items():
        started = next(t["time"] for t in job["transitions"] if t["state"] == "RUNNING")
        spans[i] = (started, job["finished_at"])
    (a_start, a_end), (b_start, b_end) = spans.values()
    assert a_start < b_end and b_start < a_end, f"the jobs ran one after the other: {spans}"
    for i in ids:
        steps = [e["metrics"] for e in events[i] if "train/loss" in e["metrics"]]
        assert len(steps) == 3
        assert all(m["train/train_rollout_logprob_abs_diff"] < 1e-3 for m in steps), (i, steps)
    with BufferClient(local_stack["buffer_addr"], timeout_s=30.0) as buffer:
        for i in ids:
            for rollout_id in range(3):
                groups = buffer.get_batch(i, rollout_id, 4, timeout_s=5)
                assert len(groups) == 4
                for group in groups:
                    assert group.job_id == i and group.group_id.startswith(f"{i}:")
                    for sample in group.samples:
                        assert sample.lora_name == i  # generated with its own adapter, named by its job id
                        assert sample.weight_versions == [str(rollout_id)]  # its own adapter's version
    a, b = (load_file(tmp_path / i / "adapter_model.safetensors") for i in ids)
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max() for k in a if "lora_B" in k) > 1e-3
    for url in engine_urls(local_stack):  # each engine serves both adapters, each at its job's last version
        for i in ids:
            reply = httpx.post(f"{url}/generate", json={
                "input_ids": PROMPT, "lora_path": i, "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
                timeout=60).json()
            assert reply["meta_info"]["weight_version"] == "3", (url, i, reply)
