"""`python -m physarum.demo --model-family F`: each family has its own model directory (the default keeps `model`),
a family the chosen backend cannot build stops the demo before its stack starts, naming the backend that can, and
`--sft-set` shortens the SFT warm-up alone (a smoke run of a slow family)."""

from __future__ import annotations

import json

import pytest

from physarum.cli import load_job_file
from physarum.demo import EXAMPLES, job_overrides, refuse_unbuildable
from physarum.demo_model import model_name


def test_each_family_and_seed_has_its_own_model_directory():
    assert [model_name("qwen3", 0), model_name("qwen3", 2), model_name("qwen3_moe", 0), model_name("qwen3_5", 1)] == [
        "model", "model-seed2", "model-qwen3_moe", "model-qwen3_5-seed1"]


def test_a_family_megatron_cannot_build_stops_the_demo_naming_fsdp(tmp_path):
    # every demo family builds on megatron now: OLMo-2 (no megatron model here) stands for one that does not
    from transformers import Olmo2Config

    config = Olmo2Config(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    refuse_unbuildable(tmp_path, "fsdp")
    with pytest.raises(SystemExit, match="demo: hf_checkpoint: train_backend megatron cannot build model family "
                                         "'olmo2'.*; train_backend fsdp trains it"):
        refuse_unbuildable(tmp_path, "megatron")


def test_sft_set_reaches_the_sft_job_alone_and_wins_over_the_demo_own_settings(tmp_path):
    sft_sets, grpo_sets = job_overrides(["train_backend=megatron"], 3, tmp_path / "model",
                                        ["num_rollout=2", "seed=7"], ["num_rollout=5"])
    sft, grpo = load_job_file(EXAMPLES / "sft.yaml", sft_sets), load_job_file(EXAMPLES / "job.yaml", grpo_sets)
    assert (sft["num_rollout"], sft["seed"], sft["rollout_seed"], sft["hf_checkpoint"]) == (2, 7, 3,
                                                                                           str(tmp_path / "model"))
    assert (grpo["num_rollout"], grpo["seed"], grpo["hf_checkpoint"]) == (5, 3, ".physarum/demo/sft-model")
    assert sft["train_backend"] == grpo["train_backend"] == "megatron"


def test_a_family_demo_settings_reach_its_jobs_alone_and_the_user_sets_still_win(tmp_path):
    def jobs(family: str, sft_user: list[str], grpo_user: list[str]) -> tuple[dict, dict]:
        sft_sets, grpo_sets = job_overrides([], 0, tmp_path / "model", sft_user, grpo_user, family)
        return load_job_file(EXAMPLES / "sft.yaml", sft_sets), load_job_file(EXAMPLES / "job.yaml", grpo_sets)

    def shape(sft: dict, grpo: dict) -> tuple:
        return (sft["num_rollout"], grpo["n_samples_per_prompt"], grpo["rollout_batch_size"],
                grpo["global_batch_size"], grpo["lr"])

    assert shape(*jobs("qwen3", [], [])) == (80, 8, 64, 512, 2.0e-4)
    assert shape(*jobs("glm4_moe_lite", [], [])) == (80, 8, 64, 512, 1.0e-4)
    assert shape(*jobs("deepseek_v3", [], [])) == (120, 8, 64, 512, 1.0e-4)  # a longer warm-up too
    assert shape(*jobs("deepseek_v3", ["num_rollout=2"], ["lr=3.0e-4"])) == (2, 8, 64, 512, 3.0e-4)
