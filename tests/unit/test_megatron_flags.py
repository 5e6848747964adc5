"""Megatron's architecture flags checked against each family's own HF fields: slime's GLM-4 and Qwen3.5 scripts
agree with their models' config.json (GLM-4's interleaved half rotary and extra norms, Qwen3.5's qk-norm, (1+w)
RMSNorm and gated attention); a Qwen3-MoE script's expert sizes agree, and each wrong one is named with the value
the model has. The configs are transformers' own config classes at the real models' sizes (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.trainer.api.spec import JobSpec
from services.trainer.slime_flags import args as slime_args
from services.trainer.slime_flags.megatron_flags import check_arch

SPEC_KEYS = set(JobSpec.model_fields)
SCRIPTS = json.loads((Path(__file__).resolve().parents[1] / "data" / "slime_launch_scripts.json").read_text())


def glm_z1_9b() -> dict:
    from transformers import Glm4Config

    return Glm4Config(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                      num_attention_heads=32, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5,
                      attention_bias=True, partial_rotary_factor=0.5, max_position_embeddings=32768,
                      tie_word_embeddings=False).to_dict()


# GLM-Z1-9B-0414's config.json as the hub has it (transformers 4's layout: rope fields at the top level)
GLM_Z1_9B_HUB = {"model_type": "glm4", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
                 "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                 "rms_norm_eps": 1e-5, "attention_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                 "hidden_act": "silu", "max_position_embeddings": 32768, "tie_word_embeddings": False}


def qwen3_5_27b() -> dict:
    from transformers import Qwen3_5Config

    text = {"vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
            "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}}
    return Qwen3_5Config(text_config=text, tie_word_embeddings=False).to_dict()


def qwen3_30b_a3b() -> dict:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=40960, tie_word_embeddings=False).to_dict()


# MODEL_ARGS as slime's scripts/models/qwen3-30B-A3B.sh passes them (architecture and MoE settings)
QWEN3_30B_A3B_ARGS = [
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "32",
    "--num-query-groups", "4", "--kv-channels", "128", "--num-layers", "48", "--hidden-size", "2048",
    "--ffn-hidden-size", "6144", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "151936", "--rotary-base", "1000000", "--moe-ffn-hidden-size", "768",
    "--moe-router-score-function", "softmax", "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "8",
    "--moe-layer-freq", "'([1]*48)'", "--num-experts", "128", "--moe-grouped-gemm", "--moe-token-drop-policy",
    "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion", "--moe-aux-loss-coeff", "0"]


def disagreements(argv: list[str], hf_config: dict) -> list[str]:
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, hf_config=hf_config)
    return [r for r in conv.refused if "disagrees with hf_checkpoint" in r]


@pytest.mark.parametrize("script, hf_config", [("run-glm4-9B.sh", glm_z1_9b()), ("run-glm4-9B.sh", GLM_Z1_9B_HUB),
                                               ("run-qwen3.5-27B.sh", qwen3_5_27b())])
def test_slimes_glm4_and_qwen3_5_scripts_agree_with_their_models(script, hf_config):
    argv = SCRIPTS[script]
    assert {"--rotary-interleaved", "--qk-layernorm", "--apply-layernorm-1p"} & set(argv)  # what was refused
    assert disagreements(argv, hf_config) == []


def test_each_family_flag_is_refused_where_the_family_lacks_it():
    glm4, qwen3_5 = glm_z1_9b(), qwen3_5_27b()
    qwen3 = {**GLM_Z1_9B_HUB, "model_type": "qwen3", "partial_rotary_factor": 1.0, "attention_bias": False}
    glm4_moe = {**GLM_Z1_9B_HUB, "model_type": "glm4_moe", "n_routed_experts": 128, "use_qk_norm": True}
    for flag, hf_config, expected in [("rotary-interleaved", qwen3, False), ("rotary-interleaved", glm4_moe, False),
                                      ("apply-layernorm-1p", qwen3, False), ("apply-layernorm-1p", glm4, False),
                                      ("post-mlp-layernorm", qwen3_5, False), ("attention-output-gate", glm4, False)]:
        assert check_arch(flag, True, hf_config).startswith(f"--{flag} True disagrees with hf_checkpoint's "
                                                           f"config.json ({expected})"), flag
    for flag, hf_config in [("rotary-interleaved", glm4), ("qk-layernorm", qwen3_5), ("qk-layernorm", glm4_moe),
                            ("apply-layernorm-1p", qwen3_5), ("post-self-attn-layernorm", glm4),
                            ("use-gated-attention", qwen3_5)]:
        assert check_arch(flag, True, hf_config) == "", flag
    assert check_arch("rotary-percent", 0.5, qwen3_5).startswith("--rotary-percent 0.5 disagrees with "
                                                                 "hf_checkpoint's config.json (0.25)")
    assert check_arch("rotary-base", 10000, qwen3_5).endswith("config.json (10000000); Physarum builds the model "
                                                              "from the HF config: fix or drop the flag")
    assert check_arch("num-layers", 64, qwen3_5) == ""  # read from the text model of the multimodal checkpoint


def test_a_qwen3_moe_script_agrees_and_each_wrong_expert_size_is_named():
    hf_config = qwen3_30b_a3b()
    conv = slime_args.convert(QWEN3_30B_A3B_ARGS, spec_keys=SPEC_KEYS, hf_config=hf_config)
    assert conv.refused == [] and conv.unknown == []
    assert any(note.startswith("--moe-grouped-gemm: the backends set their own") for note in conv.notes)
    conv = slime_args.convert([*QWEN3_30B_A3B_ARGS, "--expert-model-parallel-size", "8"], spec_keys=SPEC_KEYS,
                              hf_config=hf_config)
    assert conv.spec["expert_model_parallel_size"] == 8 and conv.refused == []
    wrong = ["--num-experts", "64", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "512",
             "--moe-shared-expert-intermediate-size", "768", "--moe-layer-freq", "[0]*1+[1]*47",
             "--moe-router-score-function", "sigmoid"]
    expected = ["--num-experts 64 (128)", "--moe-router-topk 4 (8)", "--moe-ffn-hidden-size 512 (768)",
                "--moe-shared-expert-intermediate-size 768 (0)", f"--moe-layer-freq [0]*1+[1]*47 ({[1] * 48})",
                "--moe-router-score-function sigmoid (softmax)"]
    assert [r.replace(" disagrees with hf_checkpoint's config.json", "").split(";")[0]
            for r in disagreements(wrong, hf_config)] == expected


def test_deepseek_and_glm_moe_routers_are_checked_against_their_fields():
    from transformers import DeepseekV3Config, Glm4MoeConfig

    deepseek = DeepseekV3Config().to_dict()  # DeepSeek-V3's own sizes are the class defaults
    for flag, value in [("moe-layer-freq", "[0]*3+[1]*58"), ("num-experts", 256), ("moe-router-topk", 8),
                        ("moe-shared-expert-intermediate-size", 2048), ("moe-router-score-function", "sigmoid"),
                        ("moe-router-enable-expert-bias", True), ("moe-router-topk-scaling-factor", 2.5),
                        ("moe-router-num-groups", 8), ("moe-router-group-topk", 4), ("multi-latent-attention", True),
                        ("q-lora-rank", 1536), ("kv-lora-rank", 512), ("qk-head-dim", 128),
                        ("qk-pos-emb-head-dim", 64), ("v-head-dim", 128), ("qk-layernorm", True)]:
        assert check_arch(flag, value, deepseek) == "", flag
    assert check_arch("moe-layer-freq", "[1]*61", deepseek) != ""
    glm4_5_air = Glm4MoeConfig(num_hidden_layers=46, n_routed_experts=128, n_shared_experts=1,
                               moe_intermediate_size=1408, first_k_dense_replace=1).to_dict()
    assert check_arch("moe-shared-expert-intermediate-size", 1408, glm4_5_air) == ""
    assert check_arch("moe-layer-freq", "[0]*1+[1]*45", glm4_5_air) == ""
    assert check_arch("moe-router-enable-expert-bias", False, glm4_5_air) != ""
    assert check_arch("num-experts", 8, GLM_Z1_9B_HUB).startswith("--num-experts 8 disagrees with hf_checkpoint's "
                                                                "config.json (0)")  # a dense model
    assert check_arch("moe-router-topk", 8, GLM_Z1_9B_HUB) == ""  # no expert fields to check against
    # Qwen3-MoE's hub config.json spells it num_experts, transformers 5 writes num_local_experts
    hub = {k: v for k, v in qwen3_30b_a3b().items() if k != "num_local_experts"}
    assert check_arch("num-experts", 128, {**hub, "num_experts": 128}) == ""


def test_a_qwen3_moe_slime_job_is_accepted_at_submit_with_expert_parallelism(tmp_path):
    from services.common.errors import InvalidArgument
    from services.trainer.api.preflight import with_preflight
    from services.trainer.api.spec_defaults import spec_parser

    (tmp_path / "config.json").write_text(json.dumps(qwen3_30b_a3b()))
    (tmp_path / "train.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    parse = with_preflight(spec_parser({"train_backend": "megatron"}))
    argv = [*QWEN3_30B_A3B_ARGS, "--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "train.jsonl"),
            "--num-rollout", "1", "--rollout-batch-size", "8", "--expert-model-parallel-size", "8"]
    spec = parse({"slime_args": argv})
    assert (spec.train_backend, spec.expert_model_parallel_size) == ("megatron", 8)
    with pytest.raises(InvalidArgument, match=r"expert_model_parallel_size 5 must divide the number of experts "
                                              r"\(128 in qwen3_moe\)"):
        parse({"slime_args": [*argv, "--expert-model-parallel-size", "5"]})


def test_yarn_pre_softmax_shared_expert_gate_and_glm47_flash_routing_are_checked_against_each_family():
    """DeepSeek-R1's YaRN against its rope_scaling (none elsewhere: factor 1, any mscale); pre-softmax against a
    softmax router's norm_topk_prob (a sigmoid router ignores it); the shared-expert gate only where Qwen has one;
    GLM-4.7-Flash routes by sigmoid with an expert bias though its config has no field saying so, and its dense
    layers are its mlp_layer_types."""
    from transformers import DeepseekV3Config, Glm4MoeLiteConfig

    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
            "beta_slow": 1, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}
    r1 = DeepseekV3Config(rope_parameters=yarn).to_dict()
    for flag, value in [("rotary-scaling-factor", 40), ("mscale", 1.0), ("mscale-all-dim", 1.0),
                        ("moe-router-pre-softmax", True), ("no-position-embedding", True),
                        ("moe-shared-expert-gate", False)]:
        assert check_arch(flag, value, r1) == "", flag
    assert check_arch("rotary-scaling-factor", 4, r1) != ""
    assert check_arch("mscale-all-dim", 0.707, r1) != ""
    assert check_arch("moe-shared-expert-gate", True, r1) != ""
    plain = DeepseekV3Config().to_dict()  # no YaRN: a factor of 1 (Moonlight's script), any mscale
    assert check_arch("rotary-scaling-factor", 1, plain) == "" and check_arch("mscale-all-dim", 1.0, plain) == ""
    assert check_arch("rotary-scaling-factor", 40, plain) != ""
    qwen = {**qwen3_30b_a3b(), "norm_topk_prob": True}  # the hub config.json: top-k renormalized, not pre-softmax
    assert check_arch("moe-router-pre-softmax", True, qwen) != ""
    assert check_arch("moe-router-pre-softmax", True, {**qwen, "norm_topk_prob": False}) == ""
    flash = Glm4MoeLiteConfig().to_dict()
    assert "scoring_func" not in flash and "e_score_correction_bias" not in json.dumps(flash)
    assert check_arch("moe-router-score-function", "sigmoid", flash) == ""
    assert check_arch("moe-router-score-function", "softmax", flash) != ""
    assert check_arch("moe-router-enable-expert-bias", True, flash) == ""
    assert check_arch("moe-layer-freq", "[0]*1+[1]*46", flash) == ""
    assert check_arch("moe-layer-freq", "[0]*3+[1]*44", flash) != ""
    assert check_arch("add-qkv-bias", True, flash) == ""  # MLA's projections have no bias whatever the flag says


@pytest.mark.parametrize(("coeff", "kept"), [("0", False), ("0.001", True)])
def test_seq_and_global_aux_loss_run_as_none_without_a_weight_and_as_themselves_with_one(coeff, kept):
    for kind in ("seq_aux_loss", "global_aux_loss"):
        conv = slime_args.convert(["--moe-router-load-balancing-type", kind, "--moe-aux-loss-coeff", coeff],
                                  spec_keys=SPEC_KEYS, check_architecture=False)
        assert conv.refused == []
        assert conv.spec["moe_router_load_balancing_type"] == (kind if kept else "none")


def test_make_vocab_size_divisible_by_goes_to_the_megatron_section():
    conv = slime_args.convert(["--make-vocab-size-divisible-by", "64"], spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.megatron == {"make_vocab_size_divisible_by": 64} and conv.refused == []


def test_glm5_sparse_attention_flags_are_checked_against_its_config():
    from physarum.families import tiny_config

    glm5 = tiny_config("glm_moe_dsa", vocab_size=40, eos_id=0, hidden_size=64).to_dict()
    for flag, value in (("experimental-attention-variant", "dsa"), ("dsa-indexer-n-heads", 8),
                        ("dsa-indexer-head-dim", 16), ("dsa-indexer-topk", 4), ("multi-latent-attention", True),
                        ("moe-router-score-function", "sigmoid"), ("moe-router-enable-expert-bias", True)):
        assert check_arch(flag, value, glm5) == "", flag
    assert check_arch("dsa-indexer-topk", 2048, glm5).startswith("--dsa-indexer-topk 2048 disagrees with "
                                                                 "hf_checkpoint's config.json (4)")
    qwen3 = tiny_config("qwen3", vocab_size=40, eos_id=0, hidden_size=64).to_dict()
    assert check_arch("experimental-attention-variant", "dsa", qwen3).startswith(
        "--experimental-attention-variant dsa disagrees with hf_checkpoint's config.json (none)")
    conv = slime_args.convert(["--dsa-indexer-loss-coeff", "0.001", "--dsa-indexer-use-sparse-loss"],
                              spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.megatron == {"dsa_indexer_loss_coeff": 0.001, "dsa_indexer_use_sparse_loss": True}
