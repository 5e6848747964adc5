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

MEGATRON_BUILDS = {"qwen3", "qwen2", "llama", "qwen3_moe", "deepseek_v3", "glm4_moe_lite", "glm4_moe", "glm4",
                   "minimax_m2", "glm_moe_dsa", "qwen3_5", "qwen3_5_moe", "qwen3_next"}
MEGATRON_REFUSAL = ("hf_checkpoint: train_backend megatron cannot build model family '{family}': model_type "
                    "'{model_type}' is not supported (supported: qwen2, mimo, qwen3, qwen3_moe, llama, glm4, glm4_moe, "
                    "minimax_m2, deepseek_v3, glm4_moe_lite, glm_moe_dsa, qwen3_next, qwen3_5, qwen3_5_moe, "
                    "qwen2_5_vl, qwen3_vl); train_backend fsdp trains it")



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
                "rollout_batch_size": 1, "train_backend": train_backend,
                "rollout_max_response_len": 32}  # within the tiny models' 128-position context

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
    assert MEGATRON_REFUSAL.format(family=family, model_type=model_type) in str(err.value)


def test_a_family_megatron_does_not_build_is_refused_at_submit_through_the_job_parser(job):
    from transformers import Olmo2Config

    config = Olmo2Config(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4).to_dict()
    assert preflight(parse_spec(job(config, "fsdp")))
    with pytest.raises(InvalidArgument) as err:
        with_preflight(parse_spec)(job(config, "megatron"))
    assert MEGATRON_REFUSAL.format(family="olmo2", model_type="olmo2") in str(err.value)


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


@pytest.mark.parametrize(("change", "reason"), [
    ({"norm_topk_prob": False}, "deepseek_v3 norm_topk_prob false: megatron-core's sigmoid router always normalises"),
    ({"n_group": 2, "topk_group": 2}, "grouped top-k with num_experts_per_tok 2 and topk_group 2: megatron-core"),
    ({"attention_bias": True}, "attention_bias: megatron-core's multi-latent attention projections have no bias"),
    ({"rope_interleave": False}, "rope_interleave false"),
])
def test_a_deepseek_v3_variant_megatron_core_routes_or_attends_otherwise_is_refused_naming_the_field(job, change,
                                                                                                   reason):
    with pytest.raises(InvalidArgument, match=reason):
        preflight(parse_spec(job({**config_of("deepseek_v3"), **change}, "megatron")))


@pytest.mark.parametrize(("change", "reason"), [
    ({"indexer_types": ["full", "shared"]},
     "glm_moe_dsa indexer_types 'shared' \\(layers \\[1\\] reuse an earlier layer's top-k\\): megatron-core "
     "0.16.1's DSAttention runs every layer's own"),
    ({"indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 1},
     "indexer_types 'shared' \\(layers \\[1\\]"),  # GLM-5's config.json spelling of the same, read as transformers does
    ({"index_head_dim": 24}, "index_head_dim 24: megatron-core's indexer Hadamard-rotates"),
])
def test_a_glm5_variant_megatron_core_cannot_sparsely_attend_is_refused_naming_the_field(job, change, reason):
    config = {key: value for key, value in {**config_of("glm_moe_dsa"), **change}.items() if value is not None}
    with pytest.raises(InvalidArgument, match=reason):
        preflight(parse_spec(job(config, "megatron")))


def test_a_glm5_config_json_reads_transformers_defaults():
    from services.trainer.models.arch import ModelArch

    arch = ModelArch.from_hf_config({"model_type": "glm_moe_dsa", "num_hidden_layers": 5, "vocab_size": 100})
    assert arch.moe_layers == (False, False, False, True, True)  # first_k_dense_replace 3
    assert (arch.dsa.index_n_heads, arch.dsa.index_head_dim, arch.dsa.index_topk) == (32, 128, 2048)
    assert arch.moe_router_topk_scaling_factor == 2.5 and arch.moe_router_score_function == "sigmoid"


def test_an_mla_layout_is_checked_against_the_latent_ranks(job):
    with pytest.raises(InvalidArgument, match="tensor_model_parallel_size 3 must divide num_attention_heads 4"):
        preflight(parse_spec({**job(config_of("glm4_moe_lite"), "megatron"), "tensor_model_parallel_size": 3}))
    shape = {**config_of("deepseek_v3"), "num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": 30,
             "qk_rope_head_dim": 8}
    with pytest.raises(InvalidArgument, match="tensor_model_parallel_size 4 must divide kv_lora_rank \\+ "
                                              "qk_rope_head_dim 38"):
        preflight(parse_spec({**job(shape, "megatron"), "tensor_model_parallel_size": 4}))


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
    assert capabilities.backends_for(composite) == ["fsdp", "megatron"]  # megatron builds its language model
    assert capabilities.backends_for(config_of("llama")) == ["fsdp", "megatron"]


def test_expert_tensor_parallelism_is_the_tensor_parallel_size_with_or_without_expert_parallelism(job):
    """Each expert cut over the TP ranks (megatron-core's expert_tensor_parallel_size), from the spec or slime's
    flag."""
    deepseek = job(config_of("deepseek_v3"), "megatron")
    spec = preflight(parse_spec({**deepseek, "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2}))
    assert spec.expert_tensor_parallel_size == 2
    both = {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2, "expert_model_parallel_size": 2}
    assert preflight(parse_spec({**deepseek, **both})).expert_model_parallel_size == 2
    with pytest.raises(InvalidArgument, match="expert_tensor_parallel_size 2: the megatron backend cuts each "
                                              "expert over the tensor-parallel ranks"):
        preflight(parse_spec({**deepseek, "expert_tensor_parallel_size": 2}))
    with pytest.raises(InvalidArgument, match="expert_tensor_parallel_size: train_backend fsdp cannot run"):
        parse_spec({**job(config_of("deepseek_v3"), "fsdp"), "expert_tensor_parallel_size": 2})
    slime = {"slime_args": ["--hf-checkpoint", deepseek["hf_checkpoint"], "--prompt-data", deepseek["prompt_data"],
                            "--num-rollout", "1", "--rollout-batch-size", "1", "--tensor-model-parallel-size", "2",
                            "--expert-tensor-parallel-size", "2", "--rollout-max-response-len", "32"]}
    assert preflight(parse_spec(slime)).expert_tensor_parallel_size == 2


def test_global_aux_loss_is_refused_on_fsdp_at_submit_and_taken_by_megatron(job):
    weighted = {"moe_aux_loss_coeff": 0.01, "moe_router_load_balancing_type": "global_aux_loss"}
    with pytest.raises(InvalidArgument, match="moe_router_load_balancing_type global_aux_loss: train_backend fsdp adds "
                                              "aux_loss or seq_aux_loss; global_aux_loss is megatron-core's"):
        preflight(parse_spec({**job(config_of("qwen3_moe"), "fsdp"), **weighted}))
    spec = parse_spec({**job(config_of("qwen3_moe"), "megatron"), **weighted})
    assert preflight(spec) is spec
    seq = parse_spec({**job(config_of("qwen3_moe"), "fsdp"), **weighted,
                      "moe_router_load_balancing_type": "seq_aux_loss"})
    assert preflight(seq) is seq
