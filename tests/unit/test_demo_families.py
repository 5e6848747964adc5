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
