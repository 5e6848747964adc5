"""Uneven pipeline stages (megatron-core's num_layers_in_first/last_pipeline_stage, slime's
--decoder-first/last-pipeline-num-layers): each stage's layers as megatron-core counts them, checked at submit."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.errors import InvalidArgument
from services.trainer.models import families as model_families
from services.trainer.models.arch import ModelArch, uneven_stage_layers

QWEN3 = {"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 61, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 64, "rope_theta": 1e4, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def test_the_ends_are_given_and_the_middle_stages_split_the_rest():
    assert uneven_stage_layers(61, 4) is None
    assert uneven_stage_layers(61, 4, last=31) == (10, 10, 10, 31)
    assert uneven_stage_layers(61, 4, first=4, last=3) == (4, 27, 27, 3)
    assert uneven_stage_layers(4, 2, first=1) == (1, 3)
    assert uneven_stage_layers(4, 2, last=1) == (3, 1)
    assert uneven_stage_layers(61, 4, first=1) == (1, 20, 20, 20)
    with pytest.raises(InvalidArgument, match=r"first 2, last None of num_hidden_layers 61 leave 59 layers, which 3 "
                                              r"middle stages cannot split evenly"):
        uneven_stage_layers(61, 4, first=2)
    with pytest.raises(InvalidArgument, match="need pipeline_model_parallel_size > 1"):
        uneven_stage_layers(4, 1, first=1)


def test_a_stage_holds_its_layers_in_order():
    arch = ModelArch.from_hf_config({**QWEN3, "num_hidden_layers": 4})
    assert [arch.stage_layer_range(r, 2) for r in range(2)] == [range(0, 2), range(2, 4)]
    uneven = dataclasses.replace(arch, stage_layers=(1, 3))
    assert [uneven.stage_layer_range(r, 2) for r in range(2)] == [range(0, 1), range(1, 4)]


def test_submit_takes_an_uneven_pipeline_that_adds_up():
    # 61 layers: 4 stages cannot split them evenly, but 10 + 10 + 10 + 31 can
    assert "must divide num_hidden_layers 61" in model_families.megatron_problem(QWEN3, pp_size=4)
    assert model_families.megatron_problem(QWEN3, pp_size=4, pipeline_ends={"first": None, "last": 31}) == ""
    assert "cannot split evenly" in model_families.megatron_problem(QWEN3, pp_size=4,
                                                                    pipeline_ends={"first": 2, "last": 30})
