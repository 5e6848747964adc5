"""FSDP2 over two trainer ranks (processes, gloo) trains a MoE family and Qwen3.5's hybrid linear attention exactly
like one process: the same per-step metrics and the same weights in the HF export."""

from __future__ import annotations

import json

import pytest
import torch

from services.trainer.distributed.parallel import World
from tests.integration.family_ranks import train
from tests.integration.workers import run_ranks

FAMILIES = ("qwen3_moe", "qwen3_5")


@pytest.fixture(scope="module")
def model_dirs(family_model_dir):
    return [family_model_dir(family) for family in FAMILIES]


@pytest.fixture(scope="module")
def two_ranks(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("family-two-ranks")
    run_ranks("tests.integration.family_ranks", str(out), *map(str, model_dirs), log_dir=out, timeout_s=240)
    return out, json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_train_the_family_like_one_process(two_ranks, model_dirs, family, tmp_path):
    from safetensors.torch import load_file

    model_dir = model_dirs[FAMILIES.index(family)]
    single = train(model_dir, tmp_path, World())
    sharded = two_ranks[1][model_dir.name]
    assert len(single) == len(sharded) == 2
    for one, two in zip(single, sharded, strict=True):
        assert one.keys() == two.keys()
        for key, value in one.items():
            assert two[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert abs(single[1]["train/ppo_kl"]) > 1e-6  # the second step saw the policy the first one moved
    one_weights = load_file(tmp_path / model_dir.name / "model.safetensors")
    two_weights = load_file(two_ranks[0] / model_dir.name / "model.safetensors")
    # a tied lm_head may be written once more from the gathered shards: then it is the embedding
    if "lm_head.weight" in two_weights.keys() - one_weights.keys():
        assert torch.equal(two_weights.pop("lm_head.weight"), two_weights["model.embed_tokens.weight"])
    assert one_weights.keys() == two_weights.keys()
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
