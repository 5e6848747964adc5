"""slime's flags: every one of slime's parser (tests/data/slime_flags.json, extracted from its arguments.py with its
defaults) has a status; slime's dense-model launch scripts (tests/data/slime_launch_scripts.json: the train.py argv
each builds, model arguments included) convert with no unknown flag; slime_args submits through parse_spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.errors import InvalidArgument
from services.trainer.api.spec import JobSpec, parse_spec
from services.trainer.slime_flags import args as slime_args
from services.trainer.slime_flags import argv as slime_argv
from services.trainer.slime_flags import flags as slime_flags
from services.trainer.slime_flags import megatron_flags

DATA = Path(__file__).parent.parent / "data"
SLIME_FLAGS = json.loads((DATA / "slime_flags.json").read_text())
SCRIPTS = json.loads((DATA / "slime_launch_scripts.json").read_text())
SPEC_KEYS = set(JobSpec.model_fields)
# Qwen3-4B's config.json (the values scripts/models/qwen3-4B.sh encodes for Megatron)
QWEN3_4B = {"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 2560, "intermediate_size": 9728,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "vocab_size": 151936, "hidden_act": "silu", "tie_word_embeddings": True,
            "attention_bias": False, "max_position_embeddings": 40960}


def test_every_slime_flag_has_a_status_and_slimes_default():
    assert set(SLIME_FLAGS) <= set(slime_flags.FLAGS)
    assert set(slime_flags.FLAGS) - set(SLIME_FLAGS) == {"sglang-router-ip", "sglang-router-port",
                                                        "sglang-router-request-timeout-secs",
                                                        "sglang-server-concurrency"}  # slime's SGLang parser's
    for name, default in SLIME_FLAGS.items():
        flag = slime_flags.FLAGS[name]
        assert flag.default == default or name in slime_flags.STORE_FALSE, name
        assert flag.status == "implemented" or flag.note, f"{name}: a mapped or refused flag says why"


def test_implemented_flags_are_spec_keys_with_slimes_default_or_a_reason():
    for name, flag in slime_flags.FLAGS.items():
        key = slime_flags.spec_key(name)
        assert (flag.status == "implemented") == (key in SPEC_KEYS), name
        if flag.status != "implemented" or name in slime_flags.DEFAULTS_DIFFER:
            continue
        spec_default = JobSpec.model_fields[key].get_default(call_default_factory=True)
        slime_default = False if name in slime_flags.STORE_FALSE else flag.default
        assert spec_default == slime_default or (slime_default is None and spec_default in ("", [])), name


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_launch_scripts_convert_with_no_unknown_flag(script):
    conv = slime_args.convert(SCRIPTS[script], spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.unknown == []
    assert conv.spec["train_backend"] == "megatron" and conv.spec["hf_checkpoint"]


def test_what_the_launch_scripts_still_cannot_use():
    refused = {script: sorted(r.split(":")[0] for r in slime_args.convert(
        argv, spec_keys=SPEC_KEYS, check_architecture=False).refused) for script, argv in SCRIPTS.items()}
    assert {s: r for s, r in refused.items() if r} == {
        "run-qwen3-4B-base-sft.sh": ["--num-epoch 3"],  # its prompt_data is not here to count
    }


def test_qwen3_4b_converts_to_spec_keys_megatron_settings_and_plugin_args():
    conv = slime_args.convert(SCRIPTS["run-qwen3-4B.sh"], spec_keys=SPEC_KEYS, hf_config=QWEN3_4B)
    assert conv.refused == []
    assert {k: conv.spec[k] for k in ("rm_type", "rollout_batch_size", "lr", "eps_clip_high", "eval_prompt_data",
                                      "tensor_model_parallel_size", "apply_chat_template", "lr_decay_style")} == {
        "rm_type": "deepscaler", "rollout_batch_size": 32, "lr": 1e-6, "eps_clip_high": 0.28,
        "eval_prompt_data": ["aime", "/root/aime-2024/aime-2024.jsonl"], "tensor_model_parallel_size": 2,
        "apply_chat_template": True, "lr_decay_style": "constant"}
    assert conv.megatron == {"sequence_parallel": True, "recompute_granularity": "full", "recompute_method": "uniform",
                             "recompute_num_layers": 1, "attention_dropout": 0.0, "hidden_dropout": 0.0,
                             "grad_reduce_in_fp32": True, "attention_softmax_in_fp32": True}
    assert conv.plugin_args["num_layers"] == 36 and conv.plugin_args["colocate"] is True
    assert conv.plugin_args["sglang_mem_fraction_static"] == 0.7
    assert any(n.startswith("--colocate: ") for n in conv.notes)
    assert any(n.startswith("--sglang-mem-fraction-static: an SGLang server option") for n in conv.notes)


def test_architecture_flags_are_checked_against_the_hf_config():
    argv = ["--num-layers", "35", "--hidden-size", "2560", "--swiglu", "--untie-embeddings-and-output-weights"]
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, hf_config=QWEN3_4B)
    assert conv.refused == [
        "--num-layers 35 disagrees with hf_checkpoint's config.json (36); Physarum builds the model from the HF "
        "config: fix or drop the flag",
        "--untie-embeddings-and-output-weights True disagrees with hf_checkpoint's config.json (False); Physarum "
        "builds the model from the HF config: fix or drop the flag"]
    assert megatron_flags.check_arch("num-layers", 36, None).endswith("no readable config.json")


def test_sequence_parallel_is_dropped_without_tensor_parallelism():
    conv = slime_args.convert(["--sequence-parallel"], spec_keys=SPEC_KEYS, check_architecture=False)
    assert "sequence_parallel" not in conv.megatron and conv.notes == [
        "--sequence-parallel: dropped without tensor parallelism, as Megatron does"]


def test_moe_router_and_routing_replay_flags_become_spec_keys():
    conv = slime_args.convert(["--moe-aux-loss-coeff", "0.001", "--moe-router-load-balancing-type", "none",
                               "--use-rollout-routing-replay", "--use-routing-replay"], spec_keys=SPEC_KEYS,
                              check_architecture=False)
    assert conv.spec.items() >= {"moe_aux_loss_coeff": 0.001, "moe_router_load_balancing_type": "none",
                                 "use_rollout_routing_replay": True, "use_routing_replay": True}.items()
    assert not conv.refused and not conv.megatron
    assert slime_args.convert(["--moe-expert-capacity-factor", "1.0"], spec_keys=SPEC_KEYS,
                              check_architecture=False).refused == [
        f"--moe-expert-capacity-factor: {slime_flags.MOE_REFUSAL}"]


def test_slimes_sft_rollout_is_sft_loss():
    conv = slime_args.convert(["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
                               "--disable-compute-advantages-and-returns"], spec_keys=SPEC_KEYS,
                              check_architecture=False)
    assert conv.spec["loss_type"] == "sft_loss" and conv.refused == []
    conv = slime_args.convert(["--rollout-function-path", "my.rollout", "--disable-compute-advantages-and-returns"],
                              spec_keys=SPEC_KEYS, check_architecture=False)
    assert [r.split(":")[0] for r in conv.refused] == ["--disable-compute-advantages-and-returns"]


def test_a_users_rollout_function_data_source_and_buffer_filter_are_their_spec_keys():
    argv = ["--rollout-function-path", "my.rollout.generate_rollout", "--data-source-path", "my.source.Curriculum",
            "--buffer-filter-path", "my.source.newest_first"]
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.refused == [] and conv.spec.items() >= {
        "rollout_function_path": "my.rollout.generate_rollout", "data_source_path": "my.source.Curriculum",
        "buffer_filter_path": "my.source.newest_first"}.items()
    # slime's own defaults named explicitly are the spec's defaults: nothing to import under the allow-list
    defaults = ["--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout", "--data-source-path",
                "slime.rollout.data_source.RolloutDataSourceWithBuffer", "--buffer-filter-path",
                "slime.rollout.data_source.pop_first"]
    conv = slime_args.convert(defaults, spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.refused == [] and not {"rollout_function_path", "data_source_path", "buffer_filter_path"} & set(
        conv.spec)


def test_slime_args_submit_through_parse_spec(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    argv = (f"--hf-checkpoint {tmp_path} --prompt-data d.jsonl --input-key prompt --rollout-batch-size 4 "
            "--n-samples-per-prompt 2 --num-rollout 10 --global-batch-size 8 --rm-type dapo --reward-key score "
            "--num-layers 36 --lr-warmup-fraction 0.5 --colocate --context-parallel-size 1 "
            "--rollout-max-context-len 4096 # a comment, as in a launch script\n")
    spec = parse_spec({"slime_args": argv, "job_id": "j", "train_backend": "fsdp", "plugin_args": {"extra": 1}})
    assert (spec.train_backend, spec.rm_type, spec.reward_key, spec.input_key, spec.lr_warmup_iters) == \
        ("fsdp", "dapo", "score", "prompt", 5)  # the spec's own train_backend wins; 0.5 × 10 optimizer steps
    assert any(n.startswith("--colocate: ") for n in spec.slime_notes)
    args = spec.rollout.args
    assert (args["rollout_max_context_len"], args["context_parallel_size"], args["extra"], args["colocate"]) == \
        (4096, 1, 1, True)
    assert args["tool_key"] == "tools" and args["use_wandb"] is False  # slime's defaults for what is not given


def test_refused_and_unknown_flags_are_all_reported_at_once():
    with pytest.raises(InvalidArgument) as err:
        parse_spec({"slime_args": ["--hf-checkpoint", "/nowhere", "--prompt-data", "d", "--num-rollout", "1",
                                   "--rollout-batch-size", "1", "--use-rollout-entropy", "--num-layers", "2",
                                   "--frobnicate", "3"]})
    message = str(err.value)
    assert message.startswith("slime_args: --use-rollout-entropy: the engines' entropies are not collected")
    assert "--num-layers: cannot be checked: hf_checkpoint has no readable config.json" in message
    assert message.endswith("--frobnicate: not a slime or Megatron flag Physarum knows")


def test_split_argv_reads_a_pasted_bash_array():
    assert slime_argv.split_argv('--a 1 \\\n  --b "x y" --c   # --d\n --e') == [
        ("a", ["1"]), ("b", ["x y"]), ("c", []), ("e", [])]
    with pytest.raises(InvalidArgument, match="expected a --flag first, got 'x'"):
        slime_argv.split_argv(["x", "--a"])


def test_the_docs_table_is_current_and_lists_every_slime_flag():
    from tests.unit.test_config_table import load_script

    table = load_script("slime_flag_table")
    text = (Path(__file__).resolve().parents[2] / "docs" / "slime-flags.md").read_text()
    assert text == table.render(), "run .venv/bin/python scripts/slime_flag_table.py"
    assert all(f"| `--{name}` |" in text for name in SLIME_FLAGS)


def test_custom_config_path_joins_plugin_args(tmp_path):
    (tmp_path / "mis.yaml").write_text("use_tis_mis: true\nmis_threshold: 2.5\n")
    conv = slime_args.convert(["--custom-config-path", str(tmp_path / "mis.yaml")], spec_keys=SPEC_KEYS,
                              check_architecture=False)
    assert conv.refused == [] and conv.plugin_args["use_tis_mis"] is True and conv.plugin_args["mis_threshold"] == 2.5
    (tmp_path / "list.yaml").write_text("- 1\n")
    for path, why in ((tmp_path / "missing.yaml", "cannot read it"), (tmp_path / "list.yaml", "a YAML mapping")):
        conv = slime_args.convert(["--custom-config-path", str(path)], spec_keys=SPEC_KEYS, check_architecture=False)
        assert why in conv.refused[0]


def test_eval_config_becomes_the_eval_keys(tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text("eval:\n  defaults:\n    n_samples_per_eval_prompt: 4\n    temperature: 0.6\n  datasets:\n"
                      "    - {name: aime, path: /d/aime.jsonl, rm_type: deepscaler, max_response_len: 512}\n"
                      "    - {name: math500, path: /d/math.jsonl, max_response_len: 512, temperature: 1.0}\n")
    argv = ["--rm-type", "math", "--eval-config", str(config)]
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.refused == []
    assert {k: conv.spec[k] for k in ("eval_max_response_len", "n_samples_per_eval_prompt")} == \
        {"eval_max_response_len": 512, "n_samples_per_eval_prompt": 4}  # alike in every dataset: the eval_* keys
    assert conv.spec["eval_dataset_settings"] == {  # the dataset's own, else the defaults
        "aime": {"rm_type": "deepscaler", "temperature": 0.6}, "math500": {"temperature": 1.0}}
    config.write_text("datasets:\n  - {name: aime, path: /d/aime.jsonl, rm_type: deepscaler, top_k: 20, "
                      "repetition_penalty: 1.1, apply_chat_template: true}\n")
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.spec["eval_prompt_data"] == ["aime=/d/aime.jsonl"] and conv.spec["eval_top_k"] == 20
    assert conv.refused == [
        f"--eval-config {config}: `apply_chat_template: [True]` differs from the job's (None); the eval uses the job's",
        f"--eval-config {config}: `repetition_penalty` has no counterpart in Physarum's eval"]
    config.write_text("datasets:\n  - {name: ifbench, path: /d/if.jsonl, rm_type: ifbench}\n")
    with pytest.raises(InvalidArgument, match=r"eval_dataset_settings\['ifbench'\].*rm_type 'ifbench' is not "
                                              r"supported: slime's ifbench clones"):
        parse_spec({"slime_args": ["--hf-checkpoint", "/m", "--prompt-data", "d", "--num-rollout", "1",
                                   "--rollout-batch-size", "1", "--eval-config", str(config)]})


def test_num_epoch_counts_the_prompts_as_slime_does(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(f'{{"input": "{i}"}}\n' for i in range(10)) + "\n")
    argv = ["--prompt-data", str(data), "--rollout-batch-size", "3", "--num-epoch", "2"]
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.spec["num_rollout"] == 6 and conv.refused == []  # 2 × (10 // 3)
    conv = slime_args.convert(argv + ["--num-rollout", "4"], spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.spec["num_rollout"] == 4 and "--num-epoch: ignored, num_rollout is given (as slime does)" in conv.notes


def test_slimes_fully_async_rollout_is_mode_fully_async(tmp_path):
    path = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
    conv = slime_args.convert(["--rollout-function-path", path], spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.spec["mode"] == "fully_async" and conv.refused == []
    assert conv.sources["mode"] == "fully_async, from --rollout-function-path (argv[0])"
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    spec = parse_spec({"slime_args": f"--hf-checkpoint {tmp_path} --prompt-data d.jsonl --rollout-batch-size 8 "
                                     f"--n-samples-per-prompt 4 --global-batch-size 32 --num-rollout 3 "
                                     f"--rollout-function-path {path}"})
    assert spec.driver.streams and spec.rollout.max_inflight_groups == 8


def test_slimes_delta_weight_sync_flags_set_the_sync_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    argv = (f"--hf-checkpoint {tmp_path} --prompt-data d.jsonl --rollout-batch-size 4 --num-rollout 2 "
            "--global-batch-size 4 --update-weight-mode delta --update-weight-transport disk "
            f"--update-weight-disk-dir {tmp_path}/weights --update-weight-delta-encoding overwrite "
            f"--update-weight-delta-checksum adler32 --update-weight-local-checkpoint-dir /nvme")
    sync = parse_spec({"slime_args": argv, "job_id": "j", "train_backend": "fsdp"}).sync
    assert (sync.update_weight_mode, sync.weight_sync_backend, sync.update_weight_disk_dir,
            sync.update_weight_delta_encoding, sync.update_weight_delta_checksum) == \
        ("delta", "disk", f"{tmp_path}/weights", "overwrite", "adler32")
    refused = slime_args.convert("--update-weight-transport rdma", spec_keys=SPEC_KEYS, check_architecture=False)
    assert refused.invalid == ["--update-weight-transport: invalid choice: 'rdma' (choose from nccl, disk)"]
    with pytest.raises(InvalidArgument, match="update_weight_delta_checksum"):
        parse_spec({"slime_args": argv.replace("adler32", "blake3"), "job_id": "j", "train_backend": "fsdp"})


def test_slimes_distillation_reward_needs_its_teacher_url_and_its_post_process_needs_it():
    base = ["--hf-checkpoint", "/m", "--prompt-data", "d", "--num-rollout", "1", "--rollout-batch-size", "1",
            "--use-opd", "--opd-type", "sglang"]
    reward = ["--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func"]
    post = ["--custom-reward-post-process-path", "slime.rollout.on_policy_distillation.post_process_rewards"]
    with pytest.raises(InvalidArgument, match="reward_func: needs --rm-url, the teacher's /generate URL"):
        parse_spec({"slime_args": base + reward + post})
    with pytest.raises(InvalidArgument, match="post_process_rewards: it reads the teacher's reply"):
        parse_spec({"slime_args": base + post + ["--rm-url", "http://t:1/generate"]})
    spec = parse_spec({"slime_args": base + reward + ["--rm-url", "http://t:1/generate"]})
    assert (spec.opd_teacher_url, spec.opd_only, spec.custom_rm_path) == ("http://t:1/generate", True, "")
    other = parse_spec({"slime_args": base[:-3] + ["--custom-rm-path", "tests.f", "--custom-reward-post-process-path",
                                                    "tests.g"]})
    assert (other.custom_rm_path, other.custom_reward_post_process_path, other.opd_only) == ("tests.f", "tests.g",
                                                                                            False)


def test_megatrons_checkpoint_flags_pick_the_iteration_or_say_why_not():
    """--ckpt-step picks --load's iteration (an int, as Megatron-LM parses it); --ckpt-format is noted (torch_dist is
    what the megatron backend writes and Megatron-LM loads whatever its format); the weights-only switches are
    refused with what does that job here."""
    out = slime_args.convert("--load /ckpt --ckpt-step 7 --ckpt-format torch", spec_keys=SPEC_KEYS)
    assert (out.spec["load"], out.spec["ckpt_step"]) == ("/ckpt", 7)
    assert out.notes == ["--ckpt-format: train_backend megatron writes torch_dist, which Megatron-LM loads whatever "
                         "its --ckpt-format (fsdp writes its own dcp/)"]
    refused = slime_args.convert("--finetune --no-load-optim --no-load-rng", spec_keys=SPEC_KEYS).refused
    assert [line.split(":")[0] for line in refused] == ["--finetune", "--no-load-optim", "--no-load-rng"]
    assert all("load an HF export (save_hf)" in line for line in refused)


def test_num_epoch_counts_parquet_rows_and_a_row_slice(tmp_path):
    """slime counts the dataset's rows whatever its format: a Parquet file's rows, and a `path@[start:end]` slice's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": str(i)}]} for i in range(11)]), data)
    argv = ["--prompt-data", str(data), "--rollout-batch-size", "2", "--num-epoch", "3"]
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.spec["num_rollout"] == 15 and conv.refused == []  # 3 × (11 // 2)
    argv[1] = f"{data}@[1:-2]"  # rows 1..8: 8 rows
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.spec["num_rollout"] == 12 and conv.refused == []
    argv[1] = str(tmp_path / "rows.csv")
    conv = slime_args.convert(argv, spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.refused == ["--num-epoch 3: cannot count the prompts (needs a .jsonl or .parquet prompt_data, got "
                            "'.csv'); give num_rollout"]


@pytest.mark.parametrize("name", ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"])
def test_slimes_own_dynamic_filters_are_the_rollout_services_builtins(name):
    """slime's scripts name slime's own filters by import path: they are the built-ins of the same name (no plugin to
    allow-list); any other path stays a plugin path."""
    path = f"slime.rollout.filter_hub.dynamic_sampling_filters.{name}"
    conv = slime_args.convert(["--dynamic-sampling-filter-path", path], spec_keys=SPEC_KEYS, check_architecture=False)
    assert conv.spec["dynamic_sampling_filter_path"] == name
    other = slime_args.convert(["--dynamic-sampling-filter-path", "mypkg.filters.keep"], spec_keys=SPEC_KEYS,
                               check_architecture=False)
    assert other.spec["dynamic_sampling_filter_path"] == "mypkg.filters.keep"
