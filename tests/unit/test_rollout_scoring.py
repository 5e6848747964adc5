"""Group rewards (slime's --group-rm): the user's function is called once per finished group, in the manager; a
failing or malformed one gives its samples reward 0 and a reward_error, never failing the rollout."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.client import RolloutState
from services.rollout.generation.scoring import _reward_value
from tests.plugins import rollout_fns
from tests.unit.rollout_fakes import FakeBuffer, ScriptedRouter, new_manager, reply, rollout, rollout_config


def run_group_rm(tiny_model_dir, path: str, **overrides):
    buffer = FakeBuffer(4)
    router = ScriptedRouter(script=lambda body, headers: reply([17, 18, 0], "12"))
    manager, reward = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(rollout_batch_size=2, n_samples_per_prompt=3, group_rm=True, custom_rm_path=path,
                         **overrides)
    status = asyncio.run(rollout(manager, cfg, 0))
    asyncio.run(manager.close())
    assert status.state == RolloutState.DONE and not reward.calls  # the reward service is not used
    return [[(s.reward, s.reward_error) for s in g.samples] for g in buffer.rollout_groups(0)]


def test_group_reward_is_called_once_per_group_with_the_job_args(tiny_model_dir):
    rollout_fns.GROUP_CALLS.clear()
    rewards = run_group_rm(tiny_model_dir, "tests.plugins.rollout_fns.index_rewards", args={"bonus": 1.0})
    assert rewards == [[(1.0, ""), (1.1, ""), (1.2, "")]] * 2
    assert rollout_fns.GROUP_CALLS == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize(("path", "error"), [
    ("failing_group_reward", "RuntimeError: the judge is down"),
    ("short_group_reward", "expected a list of 3 rewards"),
])
def test_a_failing_group_reward_scores_zero_with_the_reason(tiny_model_dir, path, error):
    for group in run_group_rm(tiny_model_dir, f"tests.plugins.rollout_fns.{path}"):
        for reward, reward_error in group:
            assert reward == 0.0 and reward_error.startswith(f"group_rm tests.plugins.rollout_fns.{path}: ")
            assert error in reward_error


def test_group_reward_values_may_be_dicts_picked_by_reward_key():
    assert _reward_value({"score": -1.0, "acc": 0.0, "pred": "7"}, "score", "f") == (-1.0, {"score": -1.0, "acc": 0.0},
                                                                                     "")
    assert _reward_value({"acc": 1.0}, "", "f")[2] == "f: a dict reward (keys acc) needs reward_key"
    assert _reward_value(float("nan"), "", "f")[2] == "f: reward nan is not a finite number"
    assert _reward_value(True, "", "f") == (1.0, {}, "")


def test_a_reward_the_generate_function_set_is_kept(tiny_model_dir):
    buffer = FakeBuffer(2)
    router = ScriptedRouter(script=lambda body, headers: reply([17, 18, 0], "12"))
    manager, reward = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(rollout_batch_size=2, n_samples_per_prompt=3,
                         custom_generate_function_path="tests.plugins.rollout_fns.reward_in_generate")
    status = asyncio.run(rollout(manager, cfg, 0))
    asyncio.run(manager.close())
    assert status.state == RolloutState.DONE
    rewards = [[s.reward for s in g.samples] for g in buffer.rollout_groups(0)]
    assert rewards == [[100.0, 2.0, 100.0]] * 2  # odd samples scored by the service: len("12")
