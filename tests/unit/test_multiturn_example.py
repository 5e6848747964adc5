"""The shipped multi-turn example (examples/multiturn): the calculator, its reward, its dataset, and its generate
function driven by a scripted router through the rollout manager: calculator tokens masked, model tokens not."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from examples.multiturn import calculator
from examples.multiturn.build_dataset import write_dataset
from services.common.samples import Sample, Status
from services.rollout.client import RolloutState
from services.rollout.generation.prompts import PromptEncoder
from services.trainer.api.spec import parse_spec
from tests.unit.rollout_fakes import FakeBuffer, ScriptedRouter, new_manager, reply, rollout, rollout_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multiturn"


@pytest.mark.parametrize(("turn", "answer"), [
    ("3*4+5=", "17"), ("so 2*(3+4)=", "14"), ("7/2=", "3.5"), ("8/4=", "2"), ("hello=", "error"), ("1/0=", "error"),
    ("2**3=", "error"), ("(1+=", "error"), (" 5 - -3=", "8"), ("9" * 70 + "=", "error"),
])
def test_calculator(turn, answer):
    assert calculator.calculate(turn) == answer


def test_reward_is_one_when_the_last_number_is_the_label():
    def score(response: str, label: str) -> float:
        return asyncio.run(calculator.reward(None, Sample(response=response, label=label)))

    assert score("3*4+5=17\n", "17") == 1.0 and score("17 or 18", "17") == 0.0 and score("none", "17") == 0.0


def test_the_reward_loads_where_the_reward_service_runs():
    """The reward service imports the module for `reward`; its image has neither tokenizers nor the rollout
    manager's generation code, so importing them must wait for `generate`."""
    probe = ("import sys, asyncio, types\n"
             "sys.modules['tokenizers'] = None\n"  # None in sys.modules: `import tokenizers` raises ImportError
             "sys.modules['services.rollout'] = None\n"
             "from examples.multiturn import calculator\n"
             "sample = types.SimpleNamespace(response='2+3=5', label='5')\n"
             "print(asyncio.run(calculator.reward(None, sample)))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            cwd=EXAMPLE.parents[1])
    assert result.returncode == 0, result.stderr[-600:]
    assert result.stdout.strip() == "1.0"


def test_dataset_rows_are_distinct_questions_with_exact_answers(tmp_path):
    train, test = write_dataset(tmp_path, num_train=30, num_test=5, seed=1)
    rows = [json.loads(line) for path in (train, test) for line in path.read_text().splitlines()]
    assert len(rows) == 35 and len({r["input"] for r in rows}) == 35
    for row in rows:
        a, rest = row["input"].removeprefix("Compute ").split("*")
        b, c = rest.split(" ")[0].split("+")
        assert int(row["label"]) == int(a) * int(b) + int(c)


def test_job_yaml_is_a_valid_spec():
    spec = parse_spec(yaml.safe_load((EXAMPLE / "job.yaml").read_text()))
    assert spec.custom_generate_function_path == "examples.multiturn.calculator.generate"
    assert spec.custom_rm_path == "examples.multiturn.calculator.reward" and spec.eval_prompt_data


def test_generate_appends_calculator_answers_with_loss_mask_zero(tiny_model_dir):
    """Turn 1 writes "3*4=" (a call: the calculator answers "12\\n"), turn 2 writes "12" and ends."""
    encoder = PromptEncoder(tiny_model_dir)
    ids = encoder.encode_text
    eos = encoder.eos_token_id
    turns = {0: reply(ids("3*4="), "3*4=", matched="=", logprob=-0.25),
             1: reply(ids("12") + [eos], "12", matched=eos, logprob=-0.75)}
    seen = []

    def script(body, headers):
        seen.append(body)
        return turns[len(seen) - 1]

    buffer, router = FakeBuffer(1), ScriptedRouter(script=script)
    buffer.fresh[0].label = "12"
    manager, _ = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(rollout_batch_size=1, n_samples_per_prompt=1, rollout_max_response_len=20, rollout_stop=[],
                         custom_generate_function_path="examples.multiturn.calculator.generate",
                         args={"hf_checkpoint": str(tiny_model_dir)})
    status = asyncio.run(rollout(manager, cfg, 0))
    asyncio.run(manager.close())
    assert status.state == RolloutState.DONE, status.error
    (sample,) = buffer.rollout_groups(0)[0].samples
    model1, tool, model2 = ids("3*4="), ids("12\n"), ids("12") + [eos]
    assert sample.tokens[sample.prompt_length:] == model1 + tool + model2
    assert sample.loss_mask == [1] * len(model1) + [0] * len(tool) + [1] * len(model2)
    assert sample.rollout_log_probs[len(model1):len(model1) + len(tool)] == [0.0] * len(tool)
    assert sample.rollout_log_probs[:2] == [-0.25, -1.25] and sample.rollout_log_probs[-1] == -2.75
    assert sample.response == "3*4=12\n12" and sample.status == Status.COMPLETED
    assert sample.metadata["calculator_calls"] == 1 and sample.weight_versions == ["v1", "v1"]
    first, second = seen
    assert first["sampling_params"]["stop"] == ["="] and first["sampling_params"]["max_new_tokens"] == 20
    assert second["input_ids"] == sample.tokens[:sample.prompt_length] + model1 + tool
    assert second["sampling_params"]["max_new_tokens"] == 20 - len(model1) - len(tool)


def test_generate_stops_calling_after_max_calls_and_truncates_at_the_budget(tiny_model_dir):
    encoder = PromptEncoder(tiny_model_dir)
    stops = []

    def script(body, headers):
        stops.append(body["sampling_params"]["stop"])
        if "=" not in body["sampling_params"]["stop"]:  # no more calls: the model runs out of budget
            n = body["sampling_params"]["max_new_tokens"]
            return reply(encoder.encode_text("a" * n), "a" * n, finish="length")
        return reply(encoder.encode_text("1+1="), "1+1=", matched="=")

    buffer, router = FakeBuffer(1), ScriptedRouter(script=script)
    manager, _ = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(rollout_batch_size=1, n_samples_per_prompt=1, rollout_max_response_len=30, rollout_stop=[],
                         custom_generate_function_path="examples.multiturn.calculator.generate",
                         args={"hf_checkpoint": str(tiny_model_dir)})
    asyncio.run(rollout(manager, cfg, 0))
    asyncio.run(manager.close())
    (sample,) = buffer.rollout_groups(0)[0].samples
    assert stops == [["="]] * calculator.MAX_CALLS + [[]]
    assert sample.response == "1+1=2\n" * 3 + "a" * 12 and sample.response_length == 30
    assert sample.status == Status.TRUNCATED and sample.metadata["calculator_calls"] == 3
    assert sample.loss_mask == ([1] * 4 + [0] * 2) * 3 + [1] * 12
