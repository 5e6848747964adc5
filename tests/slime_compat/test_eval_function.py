"""Evaluation through the user's function (slime's --eval-function-path, which defaults to the rollout function):
the rollout service calls it with evaluation=True at each eval, and its RolloutFnEvalOutput becomes eval/*."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.errors import InvalidArgument
from tests.unit.rollout_fakes import Engine, FakeBuffer, new_manager, rollout_config


def eval_config(tiny_model_dir, tmp_path, **overrides):
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+2=", "label": str(i + 2)}) + "\n" for i in range(3)))
    values = dict(rollout_batch_size=2, n_samples_per_prompt=2, eval_prompt_data=[f"small={data}"],
                  n_samples_per_eval_prompt=2, eval_max_response_len=4,
                  args={"hf_checkpoint": str(tiny_model_dir), "rollout_temperature": 1.0, "rollout_top_p": 1.0,
                        "rollout_top_k": -1, "rollout_max_response_len": 5})
    return rollout_config(**{**values, **overrides})


def evaluate(tiny_model_dir, cfg, rollout_id=4):
    async def main():
        manager, reward = new_manager(FakeBuffer(4), Engine(), tiny_model_dir)
        try:
            return await manager.run_eval(cfg, rollout_id, str(rollout_id + 1)), reward
        finally:
            await manager.close()
    return asyncio.run(main())


def test_an_eval_function_output_becomes_the_eval_metrics(tiny_model_dir, tmp_path):
    """Its data (rewards [1, 0, 0.5], one of three truncated) and its own metrics; no prompt generated."""
    cfg = eval_config(tiny_model_dir, tmp_path, eval_function_path="tests.slime_compat.plugins.eval_rollout")
    metrics, reward = evaluate(tiny_model_dir, cfg)
    assert metrics == {"eval/made_up": pytest.approx(0.5), "eval/made_up-truncated_ratio": pytest.approx(1 / 3),
                       "eval/made_up_calls": 1.0}
    assert reward.calls == []


def test_slimes_default_eval_through_a_rollout_function_matches_the_services_own_eval(tiny_model_dir, tmp_path):
    """The rollout function is the eval function (slime's default); delegating to slime's generate_rollout it gets
    the service's eval of each dataset: 3 prompts × 2 samples scored by the reward service (len("12") = 2),
    giving the metrics the service's own eval gives."""
    own, _ = evaluate(tiny_model_dir, eval_config(tiny_model_dir, tmp_path))
    through_function, reward = evaluate(tiny_model_dir, eval_config(
        tiny_model_dir, tmp_path, rollout_function_path="tests.slime_compat.plugins.rollout_with_slimes_eval"))
    assert through_function == own
    assert own == {"eval/small": 2.0, "eval/small-truncated_ratio": 0.0, "eval/small-pass@1": 0.0,
                   "eval/small-pass@2": 0.0}
    assert reward.calls


def test_a_rollout_function_that_returns_groups_for_evaluation_is_told_what_slime_expects(tiny_model_dir, tmp_path):
    cfg = eval_config(tiny_model_dir, tmp_path,
                      rollout_function_path="tests.slime_compat.plugins.rollout_ignoring_evaluation")
    with pytest.raises(InvalidArgument, match=r"returned RolloutFnTrainOutput for evaluation=True; expected "
                                              r"RolloutFnEvalOutput"):
        evaluate(tiny_model_dir, cfg)
