"""Job-spec validation: slime's names, clear errors naming the field, slime-style argument lists."""

import pytest

from services.common.errors import InvalidArgument
from services.trainer.spec import parse_spec, slime_args_to_dict

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
    ({"kl_loss_coef": 0.1}, "kl_loss_coef is set but use_kl_loss is false"),
    ({"rollout_top_p": 1.5}, r"rollout_top_p must be in \(0, 1\]"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_spec({**BASE, **override})


def test_missing_required_key_is_named():
    with pytest.raises(InvalidArgument, match="num_rollout: Field required"):
        parse_spec({k: v for k, v in BASE.items() if k != "num_rollout"})


def test_global_batch_from_steps_per_rollout():
    assert parse_spec({**BASE, "num_steps_per_rollout": 4}).resolved_global_batch_size == 8


def test_slime_argument_list_gives_the_same_spec():
    argv = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl", "--num-rollout", "3", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "8", "--use-kl-loss", "--kl-loss-coef", "0.01", "--rollout-stop", "\n", "END"]
    spec = parse_spec(slime_args_to_dict(argv))
    assert spec.use_kl_loss is True and spec.kl_loss_coef == 0.01 and spec.rollout_batch_size == 4
    assert spec.rollout_stop == ["\n", "END"]
    with pytest.raises(InvalidArgument, match="expected a --flag"):
        slime_args_to_dict(["rollout-batch-size", "4"])
