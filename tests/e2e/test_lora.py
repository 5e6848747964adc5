"""End to end: a LoRA job trains adapters through the local stack, and the engines end with the merged weights
(W + alpha/r · B @ A) the trainer exports, since they do not serve adapters yet."""

import json

import pytest
from safetensors.torch import load_file

from services.common.sglang import SGLangClient
from tests.e2e.test_loop import engine_urls, job_spec, run


def test_lora_job_trains_adapters_and_engines_serve_the_merged_weights(local_stack, tiny_model_dir, addition_task,
                                                                        tmp_path):
    train_path, _ = addition_task
    spec = job_spec(tiny_model_dir, train_path, job_id="e2e-lora", lr=1e-2, lora_rank=4, lora_alpha=8.0,
                    target_modules=["q_proj", "v_proj", "down_proj"], use_kl_loss=True, kl_loss_coef=0.01,
                    lora_save_merged=True, save_hf=str(tmp_path / "final"))
    job, events = run(local_stack, spec)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/loss" in e["metrics"]]
    assert len(steps) == 2
    # each rollout was sampled from the policy the trainer recomputes: rollout 1 from the merged weights of step 0
    assert all(m["train/train_rollout_logprob_abs_diff"] < 1e-3 for m in steps)
    assert json.loads((tmp_path / "final" / "adapter_config.json").read_text())["r"] == 4
    merged = load_file(tmp_path / "final" / "merged" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert (merged[name] - base[name]).abs().max() > 1e-4  # the adapter moved the targeted layer
    for url in engine_urls(local_stack):
        with SGLangClient(url) as engine:
            assert engine.model_info()["weight_version"] == "2"
            got = engine.get_weights_by_name(name, truncate_size=64)
            assert got == pytest.approx(merged[name].flatten()[:64].tolist(), abs=1e-6)
