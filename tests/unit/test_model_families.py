"""Which backend builds which model family, refused at submit: a family the megatron backend cannot build names
itself and fsdp, which trains it; a model_type transformers has no causal LM for is refused for both; the families
the per-family tests train pass."""

from __future__ import annotations

import json

import pytest

from physarum.families import FAMILIES, tiny_config
from services.common.errors import InvalidArgument
from services.trainer.api.preflight import preflight, with_preflight
from services.trainer.api.spec import parse_spec
from services.trainer.backends import capabilities
from services.trainer.models import families

MEGATRON_BUILDS = {"qwen3", "qwen2", "llama", "qwen3_moe"}  # of the tiny families


def config_of(family: str) -> dict:
    return tiny_config(family, vocab_size=40, eos_id=0, hidden_size=64).to_dict()


@pytest.fixture
def job(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"input": "1+1", "label": "2"}\n')

    def make(hf_config: dict, train_backend: str) -> dict:
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(hf_config))
        return {"hf_checkpoint": str(model), "prompt_data": str(tmp_path / "train.jsonl"), "num_rollout": 1,
                "rollout_batch_size": 1, "train_backend": train_backend}

    return make


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fsdp_takes_every_family_and_megatron_only_what_it_builds(job, family):
    assert preflight(parse_spec(job(config_of(family), "fsdp")))
    spec = parse_spec(job(config_of(family), "megatron"))
    if family in MEGATRON_BUILDS:
        assert preflight(spec) is spec
        return
    with pytest.raises(InvalidArgument) as err:
        preflight(spec)
    model_type = config_of(family)["model_type"]
    assert (f"hf_checkpoint: train_backend megatron cannot build model family '{family}': model_type "
            f"'{model_type}' is not supported (supported: qwen2, qwen3, qwen3_moe, llama); train_backend fsdp trains "
            "it"
            in str(err.value))


def test_a_glm4_moe_job_for_megatron_is_refused_at_submit_through_the_job_parser(job):
    with pytest.raises(InvalidArgument, match="train_backend megatron cannot build model family 'glm4_moe'"):
        with_preflight(parse_spec)(job(config_of("glm4_moe"), "megatron"))


def test_a_model_no_backend_builds_is_refused_with_the_reason(job):
    with pytest.raises(InvalidArgument) as err:
        preflight(parse_spec(job({"model_type": "vit", "hidden_size": 64}, "fsdp")))
    assert str(err.value) == ("job spec: hf_checkpoint: train_backend fsdp cannot build model family 'vit': "
                              "transformers has no causal LM of this model_type (AutoModelForCausalLM); the fsdp "
                              "backend and the CPU engine train and serve decoder-only causal LMs")
    with pytest.raises(InvalidArgument, match="cannot build model family 't5': an encoder-decoder model"):
        preflight(parse_spec(job({"model_type": "t5", "is_encoder_decoder": True}, "fsdp")))


def test_a_variant_megatron_cannot_build_names_its_reason(job):
    sliding = {**config_of("qwen3"), "use_sliding_window": True}
    with pytest.raises(InvalidArgument, match="cannot build model family 'qwen3': use_sliding_window is not "
                                              "supported; train_backend fsdp trains it"):
        preflight(parse_spec(job(sliding, "megatron")))


def test_a_layout_megatron_cannot_cut_the_model_into_is_refused_at_submit(job):
    moe = job(config_of("qwen3_moe"), "megatron")
    assert preflight(parse_spec({**moe, "tensor_model_parallel_size": 2})).tensor_model_parallel_size == 2
    with pytest.raises(InvalidArgument, match="cannot build model family 'qwen3_moe': tensor_model_parallel_size 3 "
                                              "must divide num_attention_heads 4"):
        preflight(parse_spec({**moe, "tensor_model_parallel_size": 3}))
    with pytest.raises(InvalidArgument, match="pipeline_model_parallel_size 3 must divide num_hidden_layers 2"):
        preflight(parse_spec({**job(config_of("qwen3"), "megatron"), "pipeline_model_parallel_size": 3}))


def test_expert_parallelism_must_divide_the_experts_of_a_megatron_moe_model(job):
    moe = job(config_of("qwen3_moe"), "megatron")
    assert preflight(parse_spec({**moe, "expert_model_parallel_size": 2})).expert_model_parallel_size == 2
    with pytest.raises(InvalidArgument, match=r"expert_model_parallel_size 3 must divide the number of experts \(4 "
                                              r"in qwen3_moe\)"):
        preflight(parse_spec({**moe, "expert_model_parallel_size": 3}))
    with pytest.raises(InvalidArgument, match=r"expert_model_parallel_size 2 must divide the number of experts \(0 "):
        preflight(parse_spec({**job(config_of("llama"), "megatron"), "expert_model_parallel_size": 2}))
    for key, where in (("num_moe_experts", "is read from hf_checkpoint's config.json"),
                       ("expert_model_parallel_size", "is the job spec's own key")):
        with pytest.raises(InvalidArgument, match=f"megatron.{key}: {where}"):
            preflight(parse_spec({**moe, "megatron": {key: 2}}))
    with pytest.raises(ValueError, match="expert_model_parallel_size: .* they need train_backend: megatron"):
        parse_spec({**job(config_of("qwen3_moe"), "fsdp"), "expert_model_parallel_size": 2})


def test_a_multimodal_checkpoint_is_named_by_its_family_and_read_by_its_text_config():
    from transformers import Qwen3_5Config

    composite = Qwen3_5Config(text_config=config_of("qwen3_5")).to_dict()
    assert composite["model_type"] == "qwen3_5" and "hidden_size" not in composite
    assert families.family(composite) == families.family(config_of("qwen3_5")) == "qwen3_5"
    assert families.language_model_config(composite)["hidden_size"] == 64
    assert capabilities.backends_for(composite) == ["fsdp"]
    assert capabilities.backends_for(config_of("llama")) == ["fsdp", "megatron"]
