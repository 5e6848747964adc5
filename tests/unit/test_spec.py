"""Job-spec validation: slime's names, clear errors naming the field, slime-style argument lists."""

import dataclasses

import pytest

from services.common.errors import InvalidArgument
from services.trainer.api.spec import JobSpec, parse_spec
from services.trainer.slime_flags import args as slime_args

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 3, "rollout_batch_size": 4,
        "n_samples_per_prompt": 8}


def test_defaults_follow_slime_and_job_id_is_generated():
    spec = parse_spec(BASE)
    assert spec.job_id.startswith("job-")
    assert (spec.eps_clip, spec.kl_loss_type, spec.advantage_estimator, spec.clip_grad) == (0.2, "k1", "grpo", 1.0)
    assert spec.resolved_global_batch_size == 32


def test_unknown_key_is_named_with_a_suggestion():
    message = r"unknown key 'rollout_batchsize' \(did you mean 'rollout_batch_size'\?\)"
    with pytest.raises(InvalidArgument, match=message):
        parse_spec({**BASE, "rollout_batchsize": 4})


@pytest.mark.parametrize("override, message", [
    ({"rollout_batch_size": 0}, "rollout_batch_size must be > 0, got 0"),
    ({"global_batch_size": 5, "num_steps_per_rollout": 2},
     r"\(32\) must equal global_batch_size × num_steps_per_rollout"),
    ({"global_batch_size": 5}, r"global_batch_size \(5\) must divide"),
    ({"lr": "fast"}, "lr: Input should be a valid number"),
    ({"kl_loss_type": "k9"}, "kl_loss_type: Input should be 'k1', 'k2', 'k3' or 'low_var_kl'"),
    ({"kl_loss_coef": 0.1}, "kl_loss_coef is 0.1 but use_kl_loss is false"),
    ({"kl_coef": 0.1}, "kl_coef shapes rewards only for ppo, reinforce_plus_plus, reinforce_plus_plus_baseline; "
                       "advantage_estimator 'grpo' ignores it"),
    ({"kl_coef": 0.1, "advantage_estimator": "ppo", "use_kl_loss": True}, "exclude each other"),
    ({"advantage_estimator": "reinforce_plus_plus"}, "'reinforce_plus_plus' requires normalize_advantages: true"),
    ({"advantage_estimator": "reinforce_plus_plus_baseline"}, "requires normalize_advantages"),
    ({"advantage_estimator": "dpo"}, "advantage_estimator: Input should be 'grpo', 'gspo', 'cispo', 'ppo'"),
    ({"use_tis": True, "use_rollout_logprobs": True}, "use_tis and use_rollout_logprobs cannot be set together"),
    ({"use_dynamic_batch_size": True}, "use_dynamic_batch_size needs max_tokens_per_gpu"),
    ({"eps_clip_c": 1.0}, r"eps_clip_c must be > 1 \(dual-clip PPO\), got 1.0"),
    ({"lr_decay_style": "step"}, "lr_decay_style: Input should be 'constant', 'linear' or 'cosine'"),
    ({"lr_warmup_iters": 3}, r"lr_decay_iters \(3\) must be > lr_warmup_iters \(3\)"),  # 3 rollouts × 1 step
    ({"min_lr": 1.0}, r"min_lr must be <= lr \(1e-06\)"),
    ({"loss_type": "custom_loss"}, "loss_type 'custom_loss' and custom_loss_function_path go together"),
    ({"rollout_top_p": 1.5}, r"rollout_top_p must be in \(0, 1\]"),
    ({"mode": "async"}, "mode: Input should be 'sync', 'one_step_async' or 'fully_async'"),
    ({"mode": "fully_async", "partial_rollout": True}, "partial_rollout and over_sampling_batch_size do not apply"),
    ({"mode": "fully_async", "update_weights_interval": 3}, r"update_weights_interval 3 leaves the engines more "
                                                            r"than max_weight_staleness \(1\)"),
    ({"max_inflight_groups": 2}, r"max_inflight_groups \(2\) must be >= rollout_batch_size \(4\)"),
    ({"mode": "one_step_async", "debug_rollout_only": True}, "mode one_step_async needs engines and a trainer"),
    ({"tensor_model_parallel_size": 2}, "need train_backend: megatron"),
    # hostile numbers and names: each refused by name, never a crash later
    ({"loss_type": "custom_loss", "custom_loss_function_path": "os.system"},
     "custom_loss_function_path: 'os.system' is not under an allowed plugin module"),
    ({"global_batch_size": 0}, "global_batch_size must be > 0, got 0"),
    ({"num_steps_per_rollout": 0}, "num_steps_per_rollout must be > 0, got 0"),
    ({"lr": float("nan")}, "lr: Input should be a finite number"),
    ({"rollout_timeout_s": float("inf")}, "rollout_timeout_s: Input should be a finite number"),
    ({"lr": "Infinity"}, "lr: Input should be a finite number"),
    ({"rollout_seed": 2**64}, "rollout_seed must fit in 64 bits"),
    ({"rollout_stop_token_ids": [1, 2**70]}, "rollout_stop_token_ids must fit in 64 bits"),
    ({"job_id": "../.."}, r"job_id '../..': expected a DNS label"),
    ({"job_id": "x" * 100_000}, "expected a DNS label"),
    ({"job_id": "a\x00b"}, "expected a DNS label"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_spec({**BASE, **override})


def test_ppo_trains_its_critic_on_either_backend():
    for backend in ("fsdp", "megatron"):
        assert parse_spec({**BASE, "train_backend": backend, "advantage_estimator": "ppo"}).train.use_critic


def test_fully_async_sends_the_manager_a_stream_bound():
    assert parse_spec({**BASE, "mode": "fully_async"}).rollout.max_inflight_groups == 4  # rollout_batch_size
    assert parse_spec({**BASE, "mode": "fully_async", "max_inflight_groups": 20}).rollout.max_inflight_groups \
        == 20
    assert parse_spec({**BASE, "mode": "one_step_async", "max_inflight_groups": 20}).rollout \
        .max_inflight_groups == 0  # not a stream


def test_missing_required_key_is_named():
    with pytest.raises(InvalidArgument, match="num_rollout: Field required"):
        parse_spec({k: v for k, v in BASE.items() if k != "num_rollout"})


def test_train_config_takes_every_training_key_and_defaults_lr_decay_to_the_run():
    from services.trainer.settings.train import TrainConfig

    assert {f.name for f in dataclasses.fields(TrainConfig)} - set(JobSpec.model_fields) == {"args"}  # internal
    spec = parse_spec({**BASE, "num_steps_per_rollout": 4, "advantage_estimator": "ppo", "gamma": 0.9, "kl_coef": 0.1,
                       "loss_type": "custom_loss", "custom_loss_function_path": "tests.plugins.loss_fns.mean_nll"})
    config = spec.train
    assert (config.advantage_estimator, config.gamma, config.kl_coef, config.global_batch_size) == ("ppo", 0.9, 0.1, 8)
    assert config.custom_loss_function_path == "tests.plugins.loss_fns.mean_nll"
    assert config.lr_decay_iters == 3 * 4  # num_rollout × steps per rollout, as slime's train_iters
    assert parse_spec({**BASE, "lr_decay_iters": 5}).train.lr_decay_iters == 5
    # Megatron's optimizer defaults, which slime keeps
    assert (config.weight_decay, config.adam_beta2, config.lr_decay_style, config.min_lr) == (0.01, 0.999, "linear", 0)


def test_global_batch_from_steps_per_rollout():
    assert parse_spec({**BASE, "num_steps_per_rollout": 4}).resolved_global_batch_size == 8


def test_slime_argument_list_gives_the_same_spec():
    argv = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "3", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "8", "--use-kl-loss", "--kl-loss-coef", "0.01", "--rollout-stop", "\n", "END"]
    spec = parse_spec({"slime_args": argv})
    assert spec.use_kl_loss is True and spec.kl_loss_coef == 0.01 and spec.rollout_batch_size == 4
    assert spec.rollout_stop == ["\n", "END"]
    with pytest.raises(InvalidArgument, match="expected a --flag"):
        parse_spec({"slime_args": ["rollout-batch-size", "4"]})


def test_unknown_rm_type_is_refused_at_submit():
    base = {"hf_checkpoint": "m", "prompt_data": "d.jsonl", "num_rollout": 1, "rollout_batch_size": 1}
    with pytest.raises(InvalidArgument, match="rollout config: unknown rm_type 'deepscalar'; expected one of math"):
        parse_spec({**base, "rm_type": "deepscalar"})
    with pytest.raises(InvalidArgument, match="rm_type 'ifbench' is not supported"):
        parse_spec({**base, "rm_type": "ifbench"})
    with pytest.raises(InvalidArgument, match="rm_type remote_rm needs rm_url"):
        parse_spec({**base, "rm_type": "remote_rm"})
    assert parse_spec({**base, "rm_type": "boxed_deepscaler"}).rm_type == "boxed_deepscaler"
    assert parse_spec({**base, "rm_type": "remote_rm", "rm_url": "http://rm:8000/score"}).rm_url
    assert parse_spec({**base, "rm_type": "anything", "custom_rm_path": "pkg.mod.fn"}).custom_rm_path


def test_a_warmup_as_long_as_the_job_is_fine_with_a_constant_lr():
    spec = parse_spec({**BASE, "lr_warmup_iters": 3, "lr_decay_style": "constant"})  # 3 rollouts × 1 step
    assert spec.lr_warmup_iters == 3


def test_an_agent_trains_on_images_and_a_rollout_function_still_may_not():
    spec = parse_spec({**BASE, "train_backend": "fsdp", "multimodal_keys": {"image": "images"},
                       "agent_function_path": "tests.plugins.agent_fns.image_agent"})
    assert (spec.multimodal_keys, spec.agent_function_path) == ({"image": "images"},
                                                                 "tests.plugins.agent_fns.image_agent")
    with pytest.raises(InvalidArgument, match="multimodal_keys: data_source_path would make groups without"):
        parse_spec({**BASE, "train_backend": "fsdp", "multimodal_keys": {"image": "images"},
                    "data_source_path": "tests.plugins.rollouts.f"})


def test_multimodal_keys_come_from_slimes_flag_and_train_on_either_backend():
    conv = slime_args.convert(["--multimodal-keys", '{"image": "images"}'], spec_keys=set(JobSpec.model_fields),
                              check_architecture=False)
    assert conv.spec["multimodal_keys"] == {"image": "images"} and not conv.refused
    with pytest.raises(InvalidArgument, match="modality 'audio' is not supported"):
        parse_spec({**BASE, "multimodal_keys": {"audio": "clips"}})
    # both backends take images in the policy's forward (megatron: its language model, transformers' vision tower)
    assert parse_spec({**BASE, "train_backend": "megatron", "multimodal_keys": {"image": "images"}}
                      ).multimodal_keys == {"image": "images"}
    with pytest.raises(InvalidArgument, match="without a critic"):
        parse_spec({**BASE, "train_backend": "fsdp", "multimodal_keys": {"image": "images"},
                    "advantage_estimator": "ppo"})
    with pytest.raises(InvalidArgument, match="multimodal_keys: rollout_function_path would make groups without"):
        parse_spec({**BASE, "train_backend": "fsdp", "multimodal_keys": {"image": "images"},
                    "rollout_function_path": "tests.plugins.rollouts.f"})
    with pytest.raises(InvalidArgument, match="rollout dumps"):
        parse_spec({**BASE, "train_backend": "fsdp", "multimodal_keys": {"image": "images"},
                    "save_debug_rollout_data": "/tmp/dump_{rollout_id}.pt"})
    with pytest.raises(InvalidArgument, match="freeze_vision needs multimodal_keys"):
        parse_spec({**BASE, "freeze_vision": True})
    spec = parse_spec({**BASE, "train_backend": "fsdp", "multimodal_keys": {"image": "images"},
                       "freeze_vision": True})
    assert (spec.multimodal_keys, spec.freeze_vision) == ({"image": "images"}, True)
    assert parse_spec(BASE).multimodal_keys == {}
