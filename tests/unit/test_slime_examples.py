"""slime's example launch scripts (tests/slime_examples/launch_args.json: the train.py / train_async.py argv each script
builds, model block included) submitted as they are, with the files they name present: the models' HF config.json,
prompt rows, the YAML files. Each is accepted at submit, or refused only for features that docs/slime-flags.md lists
as refused (MoE, MTP), each with its reason, or, where TransformerEngine is not installed (as on CPU here), for
--use-precision-aware-optimizer without --optimizer-cpu-offload (megatron-core runs it only on TransformerEngine's
FusedAdam or on its CPU-offload optimizer). A slime user's one change, dropping a refused flag, is shown by appending
its accepted value (the last one wins)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from services.common import plugins
from services.common.errors import InvalidArgument
from services.trainer.api import preflight
from services.trainer.api.spec import parse_spec
from services.trainer.slime_flags import flags as slime_flags
from services.trainer.slime_flags import megatron_flags

HERE = Path(__file__).resolve().parents[1]
EXAMPLES = json.loads((HERE / "slime_examples" / "launch_args.json").read_text())
DENSE = json.loads((HERE / "data" / "slime_launch_scripts.json").read_text())
DOC = (HERE.parent / "docs" / "slime-flags.md").read_text()
_QWEN2 = {"model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768}
_QWEN3 = {"model_type": "qwen3", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000,
          "vocab_size": 151936, "head_dim": 128, "attention_bias": False, "max_position_embeddings": 40960}
_DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "rope_theta": 10000, "vocab_size": 129280,
                "max_position_embeddings": 163840, "attention_bias": False, "tie_word_embeddings": False}
_GLM47_FLASH = {"model_type": "glm4_moe_lite", "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10240,
                "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
                "num_key_value_heads": 20, "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4,
                "mlp_layer_types": ["dense"] + ["sparse"] * 46, "q_lora_rank": 768, "kv_lora_rank": 512,
                "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_group": 1, "topk_group": 1,
                "norm_topk_prob": True, "routed_scaling_factor": 1.8, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
                "vocab_size": 154880, "max_position_embeddings": 202752, "attention_bias": False,
                "tie_word_embeddings": False, "num_nextn_predict_layers": 1}
# The models' config.json values the architecture flags are checked against (the published configs' keys)
HF_CONFIGS = {
    "Qwen2.5-0.5B-Instruct": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
                              "num_hidden_layers": 24, "num_key_value_heads": 2},
    "Qwen2.5-3B": {**_QWEN2, "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
                   "num_hidden_layers": 36, "num_key_value_heads": 2},
    "Qwen3-4B": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                 "num_hidden_layers": 36, "num_key_value_heads": 8, "tie_word_embeddings": True},
    # retool's SFT of Qwen3-4B-Instruct-2507 (rope_theta 5e6, which its script sets after the model block)
    "qwen3-4b-sft": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                     "num_hidden_layers": 36, "num_key_value_heads": 8, "tie_word_embeddings": True,
                     "rope_theta": 5000000, "max_position_embeddings": 262144},
    # Qwen3-4B's FP8 checkpoint (slime's run-qwen3-4b-fp8.sh): block-wise FP8 weights, for slime's FP8 rollout
    "Qwen3-4B-FP8": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                     "num_hidden_layers": 36, "num_key_value_heads": 8, "tie_word_embeddings": True,
                     "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}},
    "Qwen3-4B-Base": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                      "num_hidden_layers": 36, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
                 "num_hidden_layers": 36, "num_key_value_heads": 8, "tie_word_embeddings": False},
    "Qwen3-30B-A3B": {**_QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4,
                      "tie_word_embeddings": False},
    "Qwen3.5-9B": {"model_type": "qwen3_5", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "num_hidden_layers": 32,
                   "rms_norm_eps": 1e-6, "rope_theta": 10000000, "partial_rotary_factor": 0.25, "vocab_size": 248320,
                   "tie_word_embeddings": False},
    # slime's MoE scripts' models (scripts/models/*.sh), their published config.json fields the flags are checked on
    "GLM-4.7-Flash": {**_GLM47_FLASH},
    "DeepSeek-R1": {**_DEEPSEEK_V3, "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0,
                                                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                                     "original_max_position_embeddings": 4096}},
    "Moonlight-16B-A3B": {**_DEEPSEEK_V3, "hidden_size": 2048, "intermediate_size": 11264,
                          "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
                          "num_experts_per_tok": 6, "first_k_dense_replace": 1, "q_lora_rank": None, "n_group": 1,
                          "topk_group": 1, "routed_scaling_factor": 2.446, "rope_theta": 50000.0,
                          "rms_norm_eps": 1e-5, "vocab_size": 163840, "max_position_embeddings": 8192},
    "Qwen3-Next-80B-A3B-Thinking": {**_QWEN3, "model_type": "qwen3_next", "hidden_size": 2048,
                                    "intermediate_size": 5120, "moe_intermediate_size": 512,
                                    "shared_expert_intermediate_size": 512, "num_experts": 512,
                                    "num_experts_per_tok": 10, "num_attention_heads": 16, "num_key_value_heads": 2,
                                    "head_dim": 256, "num_hidden_layers": 48, "rope_theta": 10000000,
                                    "partial_rotary_factor": 0.25, "norm_topk_prob": True,
                                    "full_attention_interval": 4, "tie_word_embeddings": False},
    "Qwen3.5-35B-A3B": {"model_type": "qwen3_5_moe", "tie_word_embeddings": False, "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_act": "silu", "hidden_size": 2048, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 40, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25, "rope_type": "default"},
        "vocab_size": 248320, "tie_word_embeddings": False},
        # natively multimodal: its vision tower (geo3k's VLM example trains it with images)
        "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152, "out_hidden_size": 2048},
        "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053},
}
# What each example is refused for, by flag (the flag's status in docs/slime-flags.md: refused, with the reason)
REFUSED: dict[str, set[str]] = {}  # none left: megatron builds every example's family with every feature it uses
GATED_DELTA_NET_SCRIPTS = ("fully_async_qwen3.5_9B", "qwen3_next_80B_A3B", "qwen3.5_35B_A3B_sft")
# The refused flags of slime's MoE scripts (a flag with a value drops with it), and the families megatron builds
MOE_SCRIPTS = ("glm4.7_30B_A3B", "deepseek_r1", "moonlight_16B_A3B", "qwen3_30B_A3B")
# multi_agent's --use-precision-aware-optimizer: megatron-core runs it only on TransformerEngine's FusedAdam or on its
# CPU-offload optimizer (multi_agent offloads it)
TRANSFORMER_ENGINE = importlib.util.find_spec("transformer_engine") is not None
PRECISION_REFUSAL = ("job spec: megatron.use_precision_aware_optimizer: megatron-core runs it only with "
                     "TransformerEngine's FusedAdam or with optimizer_cpu_offload, and TransformerEngine is not "
                     "installed in the trainer's image; drop it or offload the optimizer (slime: "
                     "--use-precision-aware-optimizer, --optimizer-cpu-offload)")
FAMILY_REFUSAL = "hf_checkpoint: train_backend megatron cannot build model family"
# The plugin modules the examples name (the operator's allow-list; their files are the user's)
PLUGIN_MODULES = ("generate_with_retool,generate_with_search,examples.train_infer_mismatch_helper,examples.multi_agent,"
                  "examples.geo3k_vlm_multi_turn,tests.slime_compat")


def materialize(argv: list[str], root: Path) -> list[str]:
    """The argv with slime's /root paths under `root`, and the files it reads made present there."""
    argv = [a.replace("/root/", f"{root}/root/") for a in argv]
    given = dict(zip(argv, argv[1:], strict=False))
    hf = Path(given["--hf-checkpoint"])
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(HF_CONFIGS[hf.name]))
    data = Path(given["--prompt-data"])
    data.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}]
    rows *= max(1, int(given.get("--rollout-batch-size", 1)) // len(rows))  # --num-epoch counts at least a rollout
    if data.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), data)
    else:
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for i, token in enumerate(argv):
        if token == "--eval-prompt-data":
            path = Path(argv[i + 2])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"prompt": "3+3=", "label": "6"}) + "\n")
    if "--custom-config-path" in given and "geo3k_vlm_multi_turn" in given["--custom-config-path"]:
        argv[argv.index("--custom-config-path") + 1] = str(HERE / "slime_examples" / given["--custom-config-path"])
    elif "--custom-config-path" in given:  # slime's mis.yaml settings
        path = root / "slime" / given["--custom-config-path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({
            "use_tis": True, "use_rs": True, "tis_level": "token", "rs_level": "token", "tis_mode": "truncate",
            "tis_lower_bound": 0.5, "tis_upper_bound": 2.0, "rs_lower_bound": None, "rs_upper_bound": None,
            "rs_veto_threshold": 1e-4, "tis_batch_normalize": True}))
        argv[argv.index("--custom-config-path") + 1] = str(path)
    if "--eval-config" in given:  # slime's multi_task.yaml, its datasets under root
        datasets = [{"name": "aime", "path": f"{root}/aime.jsonl", "rm_type": "deepscaler",
                     "n_samples_per_eval_prompt": 16},
                    {"name": "gpqa", "path": f"{root}/gpqa.jsonl", "rm_type": "gpqa", "n_samples_per_eval_prompt": 2}]
        for dataset in datasets:
            Path(dataset["path"]).write_text(json.dumps({"prompt": "A or B?", "label": "A"}) + "\n")
        path = Path(given["--eval-config"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({"eval": {"defaults": {"max_response_len": 16384, "top_p": 0.7},
                                                 "datasets": datasets}}))
    return argv


def submit(argv: list[str]):
    return preflight.preflight(parse_spec({"slime_args": argv}))


@pytest.fixture(autouse=True)
def allow_the_examples_plugins(monkeypatch):
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, PLUGIN_MODULES)
    monkeypatch.syspath_prepend(str(HERE / "slime_examples" / "retool"))
    monkeypatch.syspath_prepend(str(HERE / "slime_examples" / "search_r1"))
    monkeypatch.syspath_prepend(str(HERE / "slime_examples"))  # examples.train_infer_mismatch_helper, as slime's root
    monkeypatch.setattr(preflight, "CHECKS", (preflight.check_paths, preflight.check_model_family,
                                              preflight.check_megatron))  # modules: below


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_is_accepted_or_refused_only_for_a_listed_feature(name, tmp_path):
    argv = materialize(EXAMPLES[name]["argv"], tmp_path)
    if name not in REFUSED:
        spec = submit(argv)
        assert spec.train_backend == "megatron" and spec.rollout_batch_size > 0
        return
    with pytest.raises(InvalidArgument) as err:
        submit(argv)
    problems = re.split(r"; (?=--)", str(err.value).removeprefix("slime_args: "))
    if REFUSED[name] == {"family"}:  # the model family, refused at submit by the backend that cannot build it
        assert all(FAMILY_REFUSAL in p and p.endswith("train_backend fsdp trains it") for p in problems), problems
        return
    assert {p.split(":")[0].split(" ")[0] for p in problems} == REFUSED[name], problems
    for flag in REFUSED[name]:
        listed = slime_flags.FLAGS.get(flag[2:]) or megatron_flags.MEGATRON.get(flag[2:])
        checked = flag[2:] in megatron_flags.ARCH and f"| `{flag}` | checked |" in DOC
        assert (listed is not None and listed.note in DOC) or slime_flags.is_moe_flag(flag[2:]) or checked, flag
    notes = tuple((slime_flags.FLAGS.get(flag[2:]) or megatron_flags.MEGATRON[flag[2:]]).note
                  for flag in REFUSED[name] if flag[2:] in slime_flags.FLAGS or flag[2:] in megatron_flags.MEGATRON)
    assert all(p.endswith(("MoE models are not supported", slime_flags.MOE_REFUSAL,
                           *notes,
                           "Physarum builds the model from the HF config: fix or drop the flag"))
               for p in problems), problems


@pytest.mark.parametrize("name", MOE_SCRIPTS)
def test_the_moe_scripts_build_their_family_with_every_moe_flag_at_their_own_parallel_sizes(name, tmp_path):
    """DeepSeek-R1, Moonlight (deepseek_v3), GLM-4.7-Flash (glm4_moe_lite, its MTP layer trained at PP 2 × CP 2)
    and Qwen3-30B-A3B build on megatron with every MoE and model flag their scripts pass, at their own tensor,
    pipeline and expert parallel sizes."""
    argv = materialize(EXAMPLES[name]["argv"], tmp_path)
    given = dict(zip(argv, argv[1:], strict=False))
    spec = submit(argv)
    assert spec.train_backend == "megatron"
    assert spec.tensor_model_parallel_size == int(given["--tensor-model-parallel-size"])
    assert spec.pipeline_model_parallel_size == int(given["--pipeline-model-parallel-size"])
    assert spec.expert_model_parallel_size == int(given["--expert-model-parallel-size"])
    assert spec.moe_router_load_balancing_type in ("none", "aux_loss")
    if "--mtp-num-layers" in given:
        train = spec.train
        assert (spec.mtp_num_layers, train.enable_mtp_training, train.mtp_loss_scaling_factor) == (1, True, 0.2)
        assert spec.context_parallel_size == int(given["--context-parallel-size"]) == 2
    if "--moe-enable-deepep" in argv:
        assert any(note.startswith("--moe-enable-deepep: megatron-core's all-to-all") for note in spec.slime_notes)


@pytest.mark.parametrize("name", GATED_DELTA_NET_SCRIPTS)
def test_the_gated_delta_net_scripts_build_on_megatron_at_their_own_parallel_sizes(name, tmp_path):
    """Qwen3.5-9B, Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B (gated delta-nets among gated attention layers, zero-centered
    norms, the MoE ones' gated shared expert) build on megatron with every model and MoE flag their scripts pass
    (--apply-layernorm-1p, --attention-output-gate, --moe-shared-expert-gate checked against the HF config), at
    their own tensor, pipeline (Qwen3-Next's uneven: --decoder-last-pipeline-num-layers), context (Qwen3-Next's 4: the
    gated delta-nets gather each sequence over the CP group) and expert parallel sizes."""
    argv = materialize(EXAMPLES[name]["argv"], tmp_path)
    given = dict(zip(argv, argv[1:], strict=False))
    spec = submit(argv)
    assert spec.train_backend == "megatron"
    assert spec.tensor_model_parallel_size == int(given["--tensor-model-parallel-size"])
    assert spec.pipeline_model_parallel_size == int(given["--pipeline-model-parallel-size"])
    assert spec.expert_model_parallel_size == int(given["--expert-model-parallel-size"])
    assert spec.context_parallel_size == int(given["--context-parallel-size"])
    if "--decoder-last-pipeline-num-layers" in given:
        assert spec.megatron["num_layers_in_last_pipeline_stage"] == int(given["--decoder-last-pipeline-num-layers"])
    if "--loss-mask-type" in given:  # the Qwen3.5 SFT script's chat mask
        assert spec.loss_mask_type == given["--loss-mask-type"] == "qwen3_5"


def test_multi_agent_without_the_offload_flag_needs_transformer_engine_for_its_optimizer(tmp_path):
    """--use-precision-aware-optimizer without --optimizer-cpu-offload: megatron-core runs it only on
    TransformerEngine's FusedAdam."""
    argv = [a for a in materialize(EXAMPLES["multi_agent"]["argv"], tmp_path) if a != "--optimizer-cpu-offload"]
    if TRANSFORMER_ENGINE:
        assert submit(argv).train_backend == "megatron"
        return
    with pytest.raises(InvalidArgument) as err:
        submit(argv)
    assert str(err.value) == PRECISION_REFUSAL


def test_what_each_accepted_example_becomes(tmp_path):
    specs = {name: submit(materialize(EXAMPLES[name]["argv"], tmp_path / name))
             for name in ("fully_async_qwen2.5_0.5B", "retool", "search_r1", "eval_multi_task")}
    assert specs["fully_async_qwen2.5_0.5B"].driver.streams  # slime's fully-async rollout function
    assert specs["retool"].custom_generate_function_path == "generate_with_retool.generate"
    assert specs["retool"].plugin_args["rotary_base"] == 5000000  # the later of its two --rotary-base
    assert specs["search_r1"].prompt_data.endswith("train.parquet")
    multi = specs["eval_multi_task"]
    assert [e.split("=")[0] for e in multi.eval_prompt_data] == ["aime", "gpqa"]
    assert multi.eval_max_response_len == 16384 and multi.eval_top_p == 0.7
    assert multi.eval_dataset_settings == {"aime": {"rm_type": "deepscaler", "n_samples_per_eval_prompt": 16},
                                           "gpqa": {"rm_type": "gpqa", "n_samples_per_eval_prompt": 2}}


def test_sequence_parallel_reaches_megatron_wherever_tensor_parallelism_does(tmp_path):
    """Each accepted example passes --sequence-parallel: at TP > 1 megatron-core runs it (rows padded to a multiple
    of the TP size, tests/integration/test_megatron_sequence_parallel.py); at TP 1 it is dropped, as Megatron does."""
    for name in sorted(set(EXAMPLES) - set(REFUSED)):
        spec = submit(materialize(EXAMPLES[name]["argv"], tmp_path / name))
        assert "--sequence-parallel" in EXAMPLES[name]["argv"], name
        tensor_parallel = spec.tensor_model_parallel_size > 1
        assert spec.megatron.get("sequence_parallel", False) is tensor_parallel, name
        assert ("--sequence-parallel: dropped without tensor parallelism, as Megatron does" in spec.slime_notes) \
            is not tensor_parallel, name


def test_the_on_policy_distillation_examples_become_a_teacher_engine_or_a_teacher_model(tmp_path):
    """slime's sglang type: its reward function (the teacher at --rm-url) and post-process become the rollout
    service's teacher call with reward 0; the megatron type: a teacher model in the trainer from opd_teacher_load."""
    specs = {name: submit(materialize(EXAMPLES[name]["argv"], tmp_path / name))
             for name in ("on_policy_distillation_sglang", "on_policy_distillation_megatron")}
    sglang, megatron = specs["on_policy_distillation_sglang"], specs["on_policy_distillation_megatron"]
    assert (sglang.train.use_opd, sglang.train.opd_type, sglang.train.opd_kl_coef) == (True, "sglang", 1.0)
    assert sglang.rollout.opd_teacher_url == "http://127.0.0.1:13141/generate" and sglang.rollout.opd_only
    assert sglang.custom_rm_path == "" and sglang.custom_reward_post_process_path == "" and sglang.rm_url == ""
    assert sglang.slime_sources["opd_teacher_url"].startswith("--rm-url (argv[")
    assert any("opd_teacher_url" in note for note in sglang.slime_notes)
    assert (megatron.train.use_opd, megatron.train.opd_type, megatron.rm_type) == (True, "megatron", "math")
    assert megatron.train.needs_teacher_model and not megatron.rollout.opd_teacher_url
    assert megatron.driver.opd_teacher_load.endswith("/root/Qwen3-8B_torch_dist")


def test_the_mismatch_helper_example_runs_on_megatron_at_context_parallelism_2(tmp_path):
    """train_infer_mismatch_helper as it is: megatron at CP=2 (with TP=2 and sequence parallelism), MIS through
    custom_tis_function_path, its YAML's settings in slime's args."""
    argv = materialize(EXAMPLES["train_infer_mismatch_helper"]["argv"], tmp_path)
    spec = submit(argv)
    train = spec.train
    assert (spec.train_backend, spec.context_parallel_size) == ("megatron", 2)
    assert train.use_tis and train.custom_tis_function_path == \
        "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
    assert (train.args["tis_mode"], train.args["rs_veto_threshold"], train.args["tis_batch_normalize"]) == \
        ("truncate", 1e-4, True)


def test_the_examples_plugin_modules_are_checked_at_submit(tmp_path):
    """retool's, search-r1's, the mismatch helper's and multi_agent's modules are importable (tests/slime_examples); a
    module the images do not hold fails the submit naming it."""
    all_checks = (preflight.check_paths, preflight.check_megatron, preflight.check_plugins)
    for name in ("retool", "search_r1"):
        spec = parse_spec({"slime_args": materialize(EXAMPLES[name]["argv"], tmp_path / name)})
        assert [problem for check in all_checks for problem in check(spec)] == []
    argv = materialize(EXAMPLES["train_infer_mismatch_helper"]["argv"], tmp_path / "mis") + [
        "--context-parallel-size", "1"]
    assert preflight.check_plugins(parse_spec({"slime_args": argv})) == []
    argv = [a for a in materialize(EXAMPLES["multi_agent"]["argv"], tmp_path / "multi_agent")
            if a != "--optimizer-cpu-offload"]
    assert preflight.check_plugins(parse_spec({"slime_args": argv})) == []
    missing = "examples.multi_agent.rollout_with_no_agents.generate"
    problems = preflight.check_plugins(parse_spec({"slime_args": [*argv, "--custom-generate-function-path", missing]}))
    assert problems == ["custom_generate_function_path: module 'examples.multi_agent.rollout_with_no_agents' of "
                        f"'{missing}' is not importable (install it in the images)"]


@pytest.mark.parametrize("script", sorted(DENSE))
def test_the_dense_scripts_are_refused_only_for_listed_features(script):
    from services.trainer.api.spec import JobSpec
    from services.trainer.slime_flags import args as slime_args

    conv = slime_args.convert(DENSE[script], spec_keys=set(JobSpec.model_fields), check_architecture=False)
    assert conv.unknown == []
    for problem in conv.refused:
        flag = problem.split(":")[0].split(" ")[0][2:]
        if flag == "num-epoch":  # its prompt_data is not here to count (test_num_epoch_counts_the_prompts...)
            continue
        listed = slime_flags.FLAGS.get(flag) or megatron_flags.MEGATRON.get(flag)
        assert listed is not None and listed.status == "refused" or listed.note.startswith("1 only"), problem
        assert listed.note in DOC, problem
    given = dict(zip(DENSE[script], DENSE[script][1:], strict=False))
    tensor_parallel = int(given.get("--tensor-model-parallel-size", 1)) > 1  # megatron-core runs it only there
    assert conv.megatron.get("sequence_parallel", False) is ("--sequence-parallel" in DENSE[script] and tensor_parallel)


@pytest.mark.parametrize("script", sorted(DENSE))
def test_the_dense_scripts_megatron_settings_build_megatron_cores_optimizer_config(script):
    """Each script's `megatron:` settings are built into megatron-core's OptimizerConfig at submit: where
    TransformerEngine is not installed (as on this CPU install), --use-precision-aware-optimizer without
    --optimizer-cpu-offload is refused there by name; otherwise they build (run-qwen3-32B.sh offloads it)."""
    import importlib.util

    from services.trainer.api.spec import JobSpec
    from services.trainer.backends.megatron import args as megatron_args
    from services.trainer.slime_flags import args as slime_args

    conv = slime_args.convert(DENSE[script], spec_keys=set(JobSpec.model_fields), check_architecture=False)
    split = megatron_args.split(conv.megatron)
    distributed = conv.spec.get("use_distributed_optimizer", True)
    if split.optimizer.get("use_precision_aware_optimizer") and not split.optimizer.get("optimizer_cpu_offload") \
            and importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(InvalidArgument, match=r"megatron.use_precision_aware_optimizer: .* TransformerEngine is "
                                                  r"not installed"):
            megatron_args.check_optimizer(split.optimizer, use_distributed_optimizer=distributed)
    else:
        megatron_args.check_optimizer(split.optimizer, use_distributed_optimizer=distributed)


def test_the_fp8_script_is_refused_at_submit_for_its_fp8_checkpoint(tmp_path):
    """run-qwen3-4b-fp8.sh: slime's FP8 rollout (the engines serve Qwen3-4B-FP8, the trainer's bf16 weights are
    quantized at each sync), which Physarum does not do: refused for its checkpoint, its only such setting."""
    argv = materialize(DENSE["run-qwen3-4b-fp8.sh"], tmp_path)
    with pytest.raises(InvalidArgument) as err:
        submit(argv)
    hf = argv[argv.index("--hf-checkpoint") + 1]
    problems = [p for p in re.split(r"; (?=[a-z_]+: )", str(err.value).removeprefix("job spec: "))
                if not p.startswith("ref_load: ")]  # the bf16 model's torch_dist checkpoint: not made here
    assert problems == [f"hf_checkpoint: {hf}/config.json has a quantization_config (quant_method 'fp8'): quantized "
                        "checkpoints are not supported (the backends train bf16 or float32 weights and send them to "
                        "the engines as they are); use the model's unquantized checkpoint"]
    assert preflight.QUANTIZED_REFUSAL in DOC


def test_fp8_training_flags_are_refused_naming_the_reason():
    from services.trainer.api.spec import JobSpec
    from services.trainer.slime_flags import args as slime_args

    argv = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-param-gather"]
    conv = slime_args.convert(argv, spec_keys=set(JobSpec.model_fields), check_architecture=False)
    assert conv.unknown == [] and len(conv.refused) == 3
    assert all(megatron_flags.FP8_TRAINING_REFUSAL in problem for problem in conv.refused), conv.refused
    assert megatron_flags.FP8_TRAINING_REFUSAL in DOC


def test_a_script_moved_to_fsdp_is_told_each_megatron_flag_to_drop(tmp_path):
    """fully_async_qwen3.5_9B moved to fsdp (`--train-backend fsdp` appended), as a slime user whose family megatron
    does not build does:
    the refusal names every flag that became a Megatron setting; without them, and at fsdp's tensor parallelism 1
    (appended: the last wins), the script is accepted as it is otherwise."""
    argv = materialize(EXAMPLES["fully_async_qwen3.5_9B"]["argv"], tmp_path) + ["--train-backend", "fsdp"]
    with pytest.raises(InvalidArgument) as err:
        submit(argv)
    named = re.fullmatch(r"slime_args: (.*): Megatron settings, which train_backend fsdp does not take; drop them",
                         str(err.value))
    assert named, err.value
    megatron_only = named.group(1).split(", ")
    assert sorted(megatron_only) == ["--accumulate-allreduce-grads-in-fp32", "--attention-dropout",
                                     "--attention-softmax-in-fp32", "--hidden-dropout", "--recompute-granularity",
                                     "--recompute-method", "--recompute-num-layers", "--sequence-parallel"]
    kept, dropping = [], False
    for token in argv:
        if token.startswith("--"):
            dropping = token in megatron_only
        if not dropping:
            kept.append(token)
    spec = submit([*kept, "--tensor-model-parallel-size", "1"])
    assert (spec.train_backend, spec.mode, spec.megatron) == ("fsdp", "fully_async", {})


def test_the_base_sft_script_counts_its_parquet_epochs(tmp_path):
    """run-qwen3-4B-base-sft.sh: slime's sft_rollout is sft_loss; --num-epoch 3 over its Parquet rows (made 128 here,
    one rollout's worth) is 3 rollouts; --debug-train-only and --ref-load (its start weights, no KL) are dropped with
    a note each."""
    spec = submit(materialize(EXAMPLES["sft_qwen3_4B_base"]["argv"], tmp_path))
    assert (spec.loss_type, spec.num_rollout, spec.rollout_batch_size) == ("sft_loss", 3, 128)
    assert spec.prompt_data.endswith("openhermes2_5.parquet")
    assert "--num-epoch 3: num_rollout 3 (128 prompts, 128 per rollout)" in spec.slime_notes
    assert not spec.driver.debug_train_only and not spec.driver.ref_load


def test_the_eval_function_case_names_its_function_and_keeps_the_eval_config(tmp_path):
    """eval_multi_task with --eval-function-path: the function is the job's eval (checked at submit), each dataset's
    settings stay (they reach the service's eval the function delegates to)."""
    spec = submit(materialize(EXAMPLES["eval_function"]["argv"], tmp_path))
    assert spec.rollout.eval_function_path == "tests.slime_compat.plugins.eval_with_slimes_default"
    assert spec.eval_dataset_settings["aime"]["n_samples_per_eval_prompt"] == 16
    assert preflight.check_plugins(spec) == []
    argv = [*EXAMPLES["eval_function"]["argv"][:-1], "tests.slime_compat.plugins.no_such_function"]
    problems = preflight.check_plugins(parse_spec({"slime_args": materialize(argv, tmp_path / "missing")}))
    assert len(problems) == 1 and problems[0].startswith("eval_function_path: "), problems


def test_geo3k_trains_qwen3_5_with_its_images_on_either_backend(tmp_path):
    """slime's geo3k VLM example (Qwen3.5-35B-A3B, multimodal keys and all) is accepted on megatron as it is (its
    language model megatron's, its vision tower transformers'), and moved to fsdp as docs/slime.md's porting section
    says (`--train-backend fsdp` and parallel sizes 1 appended, then the Megatron settings its refusal names
    dropped)."""
    spec = submit(materialize(EXAMPLES["geo3k_vlm_qwen3.5_35B_A3B"]["argv"], tmp_path / "megatron"))
    assert (spec.train_backend, spec.multimodal_keys) == ("megatron", {"image": "images"})
    assert (spec.tensor_model_parallel_size, spec.expert_model_parallel_size) == (2, 8)
    argv = materialize(EXAMPLES["geo3k_vlm_qwen3.5_35B_A3B"]["argv"], tmp_path) + [
        "--train-backend", "fsdp", "--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "1"]
    with pytest.raises(InvalidArgument) as err:
        submit(argv)
    megatron_only = re.search(r"slime_args: (.*): Megatron settings, which train_backend fsdp does not take; drop them",
                              str(err.value))
    assert megatron_only, str(err.value)
    dropped = set(megatron_only[1].split(", "))
    kept, skip = [], False
    for token in argv:
        if skip and not token.startswith("--"):
            continue
        skip = token in dropped
        if not skip:
            kept.append(token)
    spec = submit(kept)
    assert (spec.train_backend, spec.multimodal_keys) == ("fsdp", {"image": "images"})
    assert spec.prompt_data.endswith("geo3k_imgurl/train.parquet") and spec.input_key == "problem"
