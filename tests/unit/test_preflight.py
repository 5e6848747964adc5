"""Submit-time checks: a path the trainer cannot see, a megatron key megatron-core lacks and a plugin that does not
import are refused at submit, all named in one message; a bad rm_type already at parsing; a good spec passes."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.trainer.api.preflight import preflight, with_preflight
from services.trainer.api.spec import parse_spec


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    return {"hf_checkpoint": str(tmp_path / "model"), "prompt_data": str(tmp_path / "train.jsonl"),
            "num_rollout": 1, "rollout_batch_size": 1}


def test_a_good_spec_passes_unchanged(paths):
    spec = parse_spec({**paths, "prompt_data": paths["prompt_data"] + "@[0:1]", "rm_type": "exact_match",
                       "custom_generate_function_path": "tests.plugins.reward_fns.args_echo",
                       "eval_prompt_data": [f"math={paths['prompt_data']}"]})
    assert preflight(spec) is spec


def test_every_problem_is_named_in_one_refusal(paths, tmp_path):
    spec = parse_spec({**paths, "hf_checkpoint": str(tmp_path / "nowhere"),
                       "prompt_data": str(tmp_path / "missing.jsonl"),
                       "dynamic_sampling_filter_path": "tests.no_such_pkg.keep"})
    with pytest.raises(InvalidArgument) as err:
        preflight(spec)
    message = str(err.value)
    assert f"hf_checkpoint: {tmp_path / 'nowhere'} is no Hugging Face model directory" in message
    assert f"prompt_data: no file {tmp_path / 'missing.jsonl'}" in message
    assert "dynamic_sampling_filter_path: module 'tests.no_such_pkg' of 'tests.no_such_pkg.keep'" in message


def test_a_train_only_job_needs_no_prompt_data(paths, tmp_path):
    """It replays dumped rollouts; no buffer reads prompt_data (slime's debug_train_only)."""
    spec = parse_spec({**paths, "prompt_data": str(tmp_path / "unused.jsonl"),
                       "load_debug_rollout_data": str(tmp_path / "dump_{rollout_id}.pt")})
    assert preflight(spec) is spec
    with pytest.raises(InvalidArgument, match="prompt_data: no file"):
        preflight(parse_spec({**paths, "prompt_data": str(tmp_path / "unused.jsonl")}))


def test_hub_ids_and_builtin_filter_names_are_not_paths(paths):
    spec = parse_spec({**paths, "hf_checkpoint": "Qwen/Qwen3-0.6B", "dynamic_sampling_filter_path": "nonzero_std"})
    assert preflight(spec) is spec


def test_a_bad_rm_type_is_refused_at_submit(paths):
    with pytest.raises(InvalidArgument, match=r"unknown rm_type 'maths'; expected one of math"):
        with_preflight(parse_spec)({**paths, "rm_type": "maths"})


def test_a_custom_reward_function_replaces_the_rm_type_check(paths):
    spec = parse_spec({**paths, "rm_type": "", "custom_rm_path": "tests.plugins.reward_fns.args_echo"})
    assert preflight(spec) is spec


def test_megatron_keys_are_checked_against_megatron_core(paths):
    base = {**paths, "train_backend": "megatron"}
    assert preflight(parse_spec({**base, "megatron": {"attention_dropout": 0.1}}))
    with pytest.raises(InvalidArgument, match=r"megatron.attn_dropout: not a field of megatron-core's"):
        preflight(parse_spec({**base, "megatron": {"attn_dropout": 0.1}}))


def test_megatron_cores_optimizer_config_is_built_at_submit(paths, monkeypatch):
    """megatron-core's OptimizerConfig checks its fields only when built: at submit, not at the job's start."""
    import importlib.util

    base = {**paths, "train_backend": "megatron"}
    real_find_spec = importlib.util.find_spec

    def transformer_engine(installed: bool) -> None:
        marker = real_find_spec("json")  # any module's spec: TransformerEngine found (its checks come after these)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (marker if installed else None)
                            if name == "transformer_engine" else real_find_spec(name, *a))

    transformer_engine(installed=True)
    with pytest.raises(InvalidArgument, match=r"megatron.use_precision_aware_optimizer, megatron.optimizer: "
                                              r"megatron-core's OptimizerConfig refused them: "
                                              r"--use-precision-aware-optimizer only supported with adam"):
        preflight(parse_spec({**base, "megatron": {"use_precision_aware_optimizer": True, "optimizer": "sgd"}}))
    with pytest.raises(InvalidArgument, match=r"refused them: --use-precision-aware-optimizer only supported with "
                                              r"distributed optimizer"):
        preflight(parse_spec({**base, "use_distributed_optimizer": False,
                              "megatron": {"use_precision_aware_optimizer": True}}))
    # without TransformerEngine (this CPU install; an image without it) it is refused by name, not by a TypeError,
    # unless megatron-core runs it on its CPU-offload optimizer
    transformer_engine(installed=False)
    with pytest.raises(InvalidArgument, match=r"^job spec: megatron.use_precision_aware_optimizer: megatron-core runs "
                                              r"it only with TransformerEngine's FusedAdam or with "
                                              r"optimizer_cpu_offload, and TransformerEngine is not installed in the "
                                              r"trainer's image; drop it or offload the optimizer \(slime: "
                                              r"--use-precision-aware-optimizer, --optimizer-cpu-offload\)$"):
        preflight(parse_spec({**base, "megatron": {"use_precision_aware_optimizer": True}}))
    assert preflight(parse_spec({**base, "megatron": {"use_precision_aware_optimizer": False}}))
    assert preflight(parse_spec({**base, "megatron": {"use_precision_aware_optimizer": True,
                                                      "optimizer_cpu_offload": True}}))
    # megatron-core's hybrid CPU-offload optimizer: accepted with the distributed optimizer, TransformerEngine or not
    transformer_engine(installed=True)
    assert preflight(parse_spec({**base, "megatron": {"optimizer_cpu_offload": True,
                                                      "overlap_cpu_optimizer_d2h_h2d": True}}))
    with pytest.raises(InvalidArgument, match=r"megatron.optimizer_cpu_offload: runs with the distributed optimizer "
                                              r"only"):
        preflight(parse_spec({**base, "use_distributed_optimizer": False, "megatron": {"optimizer_cpu_offload": True}}))


def test_the_submit_parser_parses_then_checks(paths):
    parse = with_preflight(parse_spec)
    assert parse(paths).hf_checkpoint == paths["hf_checkpoint"]
    with pytest.raises(InvalidArgument, match="prompt_data: no file"):
        parse({**paths, "prompt_data": "/nowhere.jsonl"})


def test_plugins_are_found_not_imported_and_only_under_the_allow_list(paths, monkeypatch):
    """A plugin path outside the allow-list is refused before anything of it is looked up; an allowed one that
    names no module is refused at submit; an allowed module is found without running it (a loss with the wrong
    signature fails when the trainer loads it, not at validation)."""
    import sys

    monkeypatch.delitem(sys.modules, "tests.plugins.loss_fns", raising=False)
    refused = parse_spec({**paths, "custom_generate_function_path": "evil_pkg.gen.run",
                          "loss_type": "custom_loss", "custom_loss_function_path": "tests.plugins.nope.f"})
    with pytest.raises(InvalidArgument) as err:
        preflight(refused)
    assert "custom_generate_function_path: 'evil_pkg.gen.run' is not under an allowed plugin module" in str(err.value)
    assert "custom_loss_function_path: module 'tests.plugins.nope' of 'tests.plugins.nope.f' is not importable" \
        in str(err.value)
    spec = parse_spec({**paths, "loss_type": "custom_loss",
                       "custom_loss_function_path": "tests.plugins.loss_fns.two_args"})
    assert preflight(spec) is spec
    assert "tests.plugins.loss_fns" not in sys.modules  # found on disk, never executed


def test_routing_replay_is_refused_at_submit_where_it_cannot_run(paths, tmp_path):
    import json

    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(InvalidArgument, match="routing replay: model family 'mixtral' is not one it applies to "
                                              r"\(qwen3_moe, qwen3_5_moe, qwen3_next, glm4_moe, deepseek_v3, "
                                              r"glm4_moe_lite, glm_moe_dsa\)"):
        preflight(parse_spec({**paths, "use_rollout_routing_replay": True}))
    from transformers import Qwen3MoeConfig

    qwen3_moe = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64).to_dict()
    (tmp_path / "model" / "config.json").write_text(json.dumps(qwen3_moe))
    assert preflight(parse_spec({**paths, "use_routing_replay": True})).use_routing_replay
    assert preflight(parse_spec({**paths, "use_routing_replay": True, "train_backend": "megatron"}))
    with pytest.raises(InvalidArgument, match="agent sessions do not record"):
        parse_spec({**paths, "use_rollout_routing_replay": True, "agent_function_path": "tests.plugins.agents.f"})
    megatron_tp2 = {**paths, "train_backend": "megatron", "tensor_model_parallel_size": 2}
    assert preflight(parse_spec({**megatron_tp2, "use_routing_replay": True}))
    assert preflight(parse_spec({**megatron_tp2, "use_routing_replay": True, "megatron": {"sequence_parallel": True}}))
    with pytest.raises(InvalidArgument, match="moe_aux_loss_coeff: train_backend megatron adds it to a MoE model at "
                                              "tensor_model_parallel_size 1 or under megatron.sequence_parallel"):
        preflight(parse_spec({**megatron_tp2, "moe_aux_loss_coeff": 0.01}))
    with pytest.raises(InvalidArgument, match="megatron dropout: train_backend megatron adds it to a MoE model"):
        preflight(parse_spec({**megatron_tp2, "megatron": {"hidden_dropout": 0.1}}))
    sequence_parallel = {**megatron_tp2, "megatron": {"sequence_parallel": True, "hidden_dropout": 0.1}}
    assert preflight(parse_spec({**sequence_parallel, "moe_aux_loss_coeff": 0.01}))
    assert preflight(parse_spec({**paths, "moe_aux_loss_coeff": 0.01, "train_backend": "megatron"}))
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(InvalidArgument, match="moe_aux_loss_coeff: model family 'mixtral' is not one it applies "
                                              r"to \(qwen3_moe, qwen3_5_moe, glm4_moe, deepseek_v3, glm4_moe_lite\)"):
        preflight(parse_spec({**paths, "moe_aux_loss_coeff": 0.01}))
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "glm4_moe"}))
    assert preflight(parse_spec({**paths, "moe_aux_loss_coeff": 0.01}))
    assert preflight(parse_spec({**paths, "use_rollout_routing_replay": True}))


QWEN3 = {"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "rope_theta": 1e4, "tie_word_embeddings": False}


def test_a_slime_torch_dist_checkpoint_loads_on_fsdp_when_megatron_can_convert_it(paths, tmp_path):
    """fsdp reads slime's checkpoints through the megatron backend's conversion at job start: accepted when that
    builds hf_checkpoint's model, refused naming why when not; megatron reads them as they are."""
    root = tmp_path / "Qwen3-8B_torch_dist"
    (root / "release").mkdir(parents=True)
    for name in ("metadata.json", ".metadata"):
        (root / "release" / name).write_text('{"sharded_backend": "torch_dist"}')
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    spec = parse_spec({**paths, "use_kl_loss": True, "ref_load": str(root), "train_backend": "fsdp"})
    with pytest.raises(InvalidArgument, match=r"ref_load: .*Qwen3-8B_torch_dist is a slime \(Megatron\) torch_dist "
                                              r"checkpoint, which train_backend fsdp reads through a conversion to HF "
                                              r"by the megatron backend, and that cannot build hf_checkpoint's model"):
        preflight(spec)  # config.json {}: no family the converter maps
    assert preflight(parse_spec({**paths, "use_kl_loss": True, "ref_load": str(root), "train_backend": "megatron",
                                 "rm_type": "exact_match"})).ref_load == str(root)
    (tmp_path / "model" / "config.json").write_text(json.dumps(QWEN3))
    assert preflight(parse_spec({**paths, "use_kl_loss": True, "ref_load": str(root), "load": str(root),
                                 "train_backend": "fsdp", "rm_type": "exact_match",
                                 "rollout_max_response_len": 32})).load == str(root)  # fits QWEN3's 64 positions


def test_a_checkpoint_whose_files_are_missing_is_refused_at_submit(paths, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(InvalidArgument, match=r"ref_load: .*ckpt has no release/ \(named by "
                                              r"latest_checkpointed_iteration.txt\)"):
        preflight(parse_spec({**paths, "use_kl_loss": True, "ref_load": str(root), "train_backend": "megatron"}))
    (root / "iter_0000004").mkdir()
    (root / "iter_0000004" / "metadata.json").write_text("{}")  # no .metadata: a copy cut short
    with pytest.raises(InvalidArgument, match=r"load: .*iter_0000004 holds neither Physarum's checkpoint "
                                              r"\(trainer_state.json\) nor a torch_dist one"):
        preflight(parse_spec({**paths, "load": str(root), "ckpt_step": 4, "train_backend": "megatron"}))
    with pytest.raises(InvalidArgument, match=r"load: .*ckpt has no iter_0000005/ \(named by the ckpt step\)"):
        preflight(parse_spec({**paths, "load": str(root), "ckpt_step": 5, "train_backend": "megatron"}))
    (root / "latest_checkpointed_iteration.txt").write_text("latest")
    with pytest.raises(InvalidArgument, match=r"holds 'latest', not `release` or an iteration"):
        preflight(parse_spec({**paths, "load": str(root)}))


def test_slimes_rollout_hooks_are_read_not_run_at_submit_and_refused_naming_the_flag(paths, monkeypatch):
    """A rollout function, data source or buffer filter that is missing or has the wrong shape fails at submit,
    read from its source without executing its module; a good set passes."""
    import sys

    monkeypatch.delitem(sys.modules, "tests.plugins.slime_rollout", raising=False)
    good = parse_spec({**paths, "rollout_function_path": "tests.plugins.slime_rollout.generate_rollout",
                       "data_source_path": "tests.plugins.slime_rollout.TaggedDataSource",
                       "buffer_filter_path": "tests.plugins.slime_rollout.take_newest"})
    assert preflight(good) is good
    assert "tests.plugins.slime_rollout" not in sys.modules
    cases = [({"rollout_function_path": "tests.plugins.slime_rollout.nowhere"},
              "rollout_function_path: module 'tests.plugins.slime_rollout' has no 'nowhere'"),
             ({"rollout_function_path": "tests.plugins.slime_rollout.async_rollout"},
              "rollout_function_path: tests.plugins.slime_rollout.async_rollout must be a plain function"),
             ({"rollout_function_path": "tests.plugins.slime_rollout.no_evaluation"},
              "rollout_function_path: tests.plugins.slime_rollout.no_evaluation takes no `evaluation` keyword"),
             ({"rollout_function_path": "tests.plugins.slime_rollout.generate_rollout",
               "data_source_path": "tests.plugins.slime_rollout.take_newest"},
              "data_source_path: tests.plugins.slime_rollout.take_newest is a function; expected a class"),
             ({"rollout_function_path": "tests.plugins.slime_rollout.generate_rollout",
               "data_source_path": "tests.plugins.slime_rollout.NoCountDataSource"},
              "data_source_path: tests.plugins.slime_rollout.NoCountDataSource's get_samples take no argument"),
             ({"rollout_function_path": "tests.plugins.slime_rollout.generate_rollout",
               "buffer_filter_path": "tests.plugins.slime_rollout.two_params_filter"},
              "buffer_filter_path: tests.plugins.slime_rollout.two_params_filter takes 2 positional parameters"),
             ({"rollout_function_path": "evil_pkg.rollout.generate_rollout"},
              "rollout_function_path: 'evil_pkg.rollout.generate_rollout' is not under an allowed plugin module")]
    for keys, message in cases:
        with pytest.raises(InvalidArgument) as err:
            preflight(parse_spec({**paths, **keys}))
        assert message in str(err.value), str(err.value)


def test_sequence_parallel_without_tensor_parallelism_is_refused_at_submit(paths):
    """megatron-core refuses it when the trainer builds the model: at submit instead, naming what to change."""
    megatron = {**paths, "train_backend": "megatron", "megatron": {"sequence_parallel": True}}
    with pytest.raises(InvalidArgument, match=r"megatron.sequence_parallel: needs tensor_model_parallel_size > 1 "
                                              r"\(it splits each row's tokens over the tensor-parallel ranks\)"):
        preflight(parse_spec(megatron))
    assert preflight(parse_spec({**megatron, "tensor_model_parallel_size": 2}))



def test_a_job_whose_prompts_and_responses_exceed_the_models_context_is_refused_at_submit(paths, tmp_path):
    from physarum import tasks, tinymodel

    model = tmp_path / "tok-model"
    tinymodel.build_tokenizer(tasks.corpus(), model)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input": "1+1", "label": "2"}\n' + json.dumps({"input": "1+1 " * 40, "label": "2"}) + "\n")
    base = {**paths, "hf_checkpoint": str(model), "prompt_data": str(rows)}
    with pytest.raises(InvalidArgument, match="rollout_max_response_len: 64 tokens leave no room"):
        preflight(parse_spec({**base, "rollout_max_response_len": 64}))
    with pytest.raises(InvalidArgument, match=r"prompt_data: row 1's prompt is \d+ tokens; with "
                                              "rollout_max_response_len 32 it exceeds the model's context of 64"):
        preflight(parse_spec({**base, "rollout_max_response_len": 32}))
    rows.write_text('{"input": "1+1", "label": "2"}\n')
    spec = parse_spec({**base, "rollout_max_response_len": 32})
    assert preflight(spec) is spec


def test_multimodal_keys_need_a_vision_language_checkpoint(paths, tmp_path):
    """A Qwen2.5-VL checkpoint trains with its images on fsdp, and so does a Qwen3.5 one with its vision tower (a
    text job trains it as its language model); a checkpoint without a vision tower is refused at submit, saying
    why."""
    vlm = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}, "image_token_id": 7}
    (tmp_path / "model" / "config.json").write_text(json.dumps(vlm))
    job = {**paths, "train_backend": "fsdp", "multimodal_keys": {"image": "images"}}
    assert preflight(parse_spec(job)).multimodal_keys == {"image": "images"}
    (tmp_path / "model" / "config.json").write_text(json.dumps({**vlm, "model_type": "qwen3_5"}))
    assert preflight(parse_spec(job)).multimodal_keys == {"image": "images"}
    assert preflight(parse_spec({**paths, "train_backend": "fsdp"}))  # the same checkpoint trains as text
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    with pytest.raises(InvalidArgument, match="multimodal_keys: hf_checkpoint's model_type 'qwen3_5_text' has no "
                                              "vision tower"):
        preflight(parse_spec(job))
