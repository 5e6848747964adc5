"""The generation features on the trainer's side: their job-spec keys, their RolloutConfig (and its proto), the eval
schedule, and the metrics the trainer adds to a rollout's event."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument, Unavailable
from services.common.settings.rollout import RolloutConfig
from services.rollout.client import RolloutState, RolloutStatus, config_from_proto, config_to_proto
from services.trainer.api.spec import parse_spec
from services.trainer.driver.deps import TrainerDeps
from services.trainer.driver.post_rollout import eval_due, evaluate, manager_metrics

BASE = {"hf_checkpoint": "/m", "prompt_data": "/d.jsonl", "num_rollout": 5, "rollout_batch_size": 4,
        "n_samples_per_prompt": 2, "rollout_temperature": 0.8, "rollout_max_response_len": 64}


def test_spec_keys_map_to_the_rollout_config_with_eval_falling_back_to_rollout_sampling():
    spec = parse_spec({**BASE, "over_sampling_batch_size": 8,
                       "dynamic_sampling_filter_path": "check_reward_nonzero_std", "partial_rollout": True,
                       "mask_offpolicy_in_partial_rollout": True,
                       "custom_generate_function_path": "a.b.generate", "custom_rm_path": "a.b.rm", "group_rm": True,
                       "eval_prompt_data": ["aime=/e/aime.jsonl", "gsm=/e/gsm.parquet"], "eval_interval": 2,
                       "n_samples_per_eval_prompt": 8, "eval_top_p": 0.7})
    config = spec.rollout
    assert (config.over_sampling_batch_size, config.dynamic_sampling_filter_path) == (8, "check_reward_nonzero_std")
    assert config.partial_rollout and config.mask_offpolicy_in_partial_rollout and config.group_rm
    assert config.custom_generate_function_path == "a.b.generate"
    assert config.eval_datasets == {"aime": "/e/aime.jsonl", "gsm": "/e/gsm.parquet"}
    assert (config.n_samples_per_eval_prompt, config.eval_temperature, config.eval_top_p,
            config.eval_max_response_len) == (8, 0.8, 0.7, 64)
    assert (config.input_key, config.label_key, config.metadata_key) == ("input", "label", "metadata")
    assert config_from_proto(config_to_proto(config)) == config
    plain = parse_spec(BASE).rollout
    assert plain.over_sampling_batch_size == 0 and not plain.eval_prompt_data and not plain.partial_rollout


def test_slime_style_eval_prompt_data_and_flags():
    argv = ["--hf-checkpoint", "/m", "--prompt-data", "/d", "--num-rollout", "2", "--rollout-batch-size", "4",
            "--eval-prompt-data", "aime", "/e/aime.jsonl", "gsm", "/e/gsm.jsonl", "--eval-interval", "1",
            "--partial-rollout", "--over-sampling-batch-size", "6"]
    spec = parse_spec({"slime_args": argv})
    assert spec.eval_prompt_data == ["aime=/e/aime.jsonl", "gsm=/e/gsm.jsonl"] and spec.partial_rollout
    assert spec.over_sampling_batch_size == 6
    assert parse_spec({**BASE, "eval_prompt_data": ["/e/math500.jsonl"]}).eval_prompt_data == [
        "math500=/e/math500.jsonl"]


@pytest.mark.parametrize(("extra", "message"), [
    ({"over_sampling_batch_size": 3}, "over_sampling_batch_size (3) must be >= rollout_batch_size (4)"),
    ({"eval_interval": 1}, "eval_interval is set but eval_prompt_data is empty"),
    ({"eval_prompt_data": ["a", "/x", "b"]}, "expected name=path entries or name path pairs"),
    ({"eval_prompt_data": ["a=/x", "a=/y"]}, "dataset names must be unique"),
    ({"eval_prompt_data": ["a b=/x"]}, "made of letters"),
    ({"n_samples_per_eval_prompt": 0}, "n_samples_per_eval_prompt must be > 0"),
    ({"eval_top_p": 0}, "eval_top_p must be in (0, 1]"),
    ({"group_rm": True}, "group_rm needs custom_rm_path"),
    ({"mask_offpolicy_in_partial_rollout": True}, "needs partial_rollout"),
    ({"partial_rolout": True}, "did you mean 'partial_rollout'"),
])
def test_bad_generation_keys_are_rejected_by_name(extra, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_spec({**BASE, **extra})


def test_rollout_config_rejects_bad_generation_fields():
    with pytest.raises(InvalidArgument, match="over_sampling_batch_size"):
        RolloutConfig(job_id="j", rollout_batch_size=4, over_sampling_batch_size=2)
    with pytest.raises(InvalidArgument, match="is not 'name=path'"):
        RolloutConfig(job_id="j", rollout_batch_size=4, eval_prompt_data=["aime"])


def test_eval_runs_every_interval_and_after_the_last_rollout():
    spec = parse_spec({**BASE, "eval_prompt_data": ["a=/x"], "eval_interval": 2})
    assert [r for r in range(5) if eval_due(spec.driver, spec.rollout, r)] == [1, 3, 4]
    assert not any(eval_due(parse_spec(BASE).driver, parse_spec(BASE).rollout, r) for r in range(5))


class FakeRollout:
    def __init__(self, eval_error: Exception | None = None) -> None:
        self.evals = []
        self.eval_error = eval_error

    def rollout_status(self, job_id, rollout_id):
        return RolloutStatus(state=RolloutState.DONE, metrics={"rollout/reward_mean": 0.5,
                                                               "rollout/dynamic_filter/drop_zero_std_1.0": 3.0,
                                                               "rollout/function/turns": 7.0})

    def run_eval(self, config, rollout_id, weight_version, timeout_s):
        self.evals.append((config.eval_prompt_data, rollout_id, weight_version, timeout_s))
        if self.eval_error:
            raise self.eval_error
        return {"eval/a": 0.25}


def test_the_managers_counters_and_eval_when_due():
    spec = parse_spec({**BASE, "job_id": "j", "eval_prompt_data": ["a=/x"], "eval_interval": 2})
    rollout = FakeRollout()
    deps = TrainerDeps(rollout=rollout)
    assert manager_metrics(spec.driver, deps, 0) == {"rollout/dynamic_filter/drop_zero_std_1.0": 3.0,
                                                     "rollout/function/turns": 7.0}
    assert not eval_due(spec.driver, spec.rollout, 0) and rollout.evals == []
    metrics = evaluate(spec.driver, spec.rollout, deps, 1)
    assert metrics["eval/a"] == 0.25 and metrics["perf/eval_seconds"] >= 0
    assert rollout.evals == [(["a=/x"], 1, "2", 600.0)]  # evaluated with the weights pushed after rollout 1
    deps.rollout = FakeRollout(eval_error=Unavailable("no engines"))
    assert "eval/a" not in evaluate(spec.driver, spec.rollout, deps, 1)  # logged and skipped
    deps.rollout = FakeRollout(eval_error=InvalidArgument("eval dataset a (/x): no usable prompts"))
    with pytest.raises(InvalidArgument, match="no usable prompts"):
        evaluate(spec.driver, spec.rollout, deps, 1)
