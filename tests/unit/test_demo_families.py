"""`python -m physarum.demo --model-family F`: each family has its own model directory (the default keeps `model`),
and a family the chosen backend cannot build stops the demo before its stack starts, naming the backend that can."""

from __future__ import annotations

import json

import pytest

from physarum.demo import refuse_unbuildable
from physarum.demo_model import model_name
from physarum.families import tiny_config


def test_each_family_and_seed_has_its_own_model_directory():
    assert [model_name("qwen3", 0), model_name("qwen3", 2), model_name("qwen3_moe", 0), model_name("qwen3_5", 1)] == [
        "model", "model-seed2", "model-qwen3_moe", "model-qwen3_5-seed1"]


def test_a_family_megatron_cannot_build_stops_the_demo_naming_fsdp(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3_5", vocab_size=40, eos_id=0).to_dict()))
    refuse_unbuildable(tmp_path, "fsdp")
    with pytest.raises(SystemExit, match="demo: hf_checkpoint: train_backend megatron cannot build model family "
                                         "'qwen3_5'.*; train_backend fsdp trains it"):
        refuse_unbuildable(tmp_path, "megatron")
