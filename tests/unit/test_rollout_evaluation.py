"""Eval metrics: pass@k by the unbiased estimator against hand-computed values, and the eval/<name> family."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.samples import Sample, Status
from services.rollout.generation.evaluation import eval_metrics, pass_at_k, pass_ks
from tests.unit.rollout_fakes import FakeBuffer, ScriptedRouter, new_manager, reply, rollout_config, sample_of


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 1, 0.25),  # c / n
    (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
    (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
    (4, 3, 2, 1.0),  # n - c < k: every pair holds a correct one
    (4, 0, 4, 0.0),
    (8, 2, 4, 1 - 15 / 70),  # 1 - C(6,4)/C(8,4)
    (8, 3, 8, 1.0),
    (5, 1, 4, 1 - 1 / 5),  # 1 - C(4,4)/C(5,4)
])
def test_pass_at_k_matches_the_binomial_formula(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_impossible_arguments():
    for n, c, k in ((4, 1, 5), (4, 5, 1), (4, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_ks_are_powers_of_two_up_to_n():
    assert pass_ks(1) == [] and pass_ks(2) == [1, 2] and pass_ks(6) == [1, 2, 4] and pass_ks(8) == [1, 2, 4, 8]


def test_eval_metrics_of_two_prompts():
    def group(*rewards, truncated=()):
        return [Sample(reward=r, status=Status.TRUNCATED if i in truncated else Status.COMPLETED)
                for i, r in enumerate(rewards)]

    groups = [group(1.0, 0.0, 0.0, 0.0, truncated=(1,)), group(1.0, 1.0, 0.5, 0.0)]  # 0.5 is not a pass
    metrics = eval_metrics("aime", groups)
    assert metrics == pytest.approx({
        "eval/aime": 3.5 / 8,
        "eval/aime-truncated_ratio": 1 / 8,
        "eval/aime-pass@1": (1 / 4 + 2 / 4) / 2,
        "eval/aime-pass@2": ((1 - 3 / 6) + (1 - 1 / 6)) / 2,
        "eval/aime-pass@4": 1.0,
    })
    assert eval_metrics("one", [[Sample(reward=1.0)], [Sample(reward=0.0)]]) == {
        "eval/one": 0.5, "eval/one-truncated_ratio": 0.0}  # no pass@k with one sample per prompt, as in slime
    assert eval_metrics("none", []) == {}


def test_run_eval_generates_every_prompt_with_eval_sampling_and_gives_the_prompts_back(tiny_model_dir, tmp_path):
    """3 eval prompts x 4 samples; prompt i's first c_i requests answer "1" (reward 1), the others "12" (reward 2,
    not a pass): c = 4, 1, 0."""
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    served = {0: 0, 1: 0, 2: 0}
    correct = {0: 4, 1: 1, 2: 0}

    def script(body, headers):
        prompt = sample_of(body)[0]
        served[prompt] += 1
        return reply([17], "1") if served[prompt] <= correct[prompt] else reply([17, 18], "12", finish="length")

    buffer, router = FakeBuffer(2), ScriptedRouter(script=script)
    manager, reward = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(eval_prompt_data=[f"math={data}"], n_samples_per_eval_prompt=4, eval_temperature=0.3,
                         eval_top_p=0.5, eval_max_response_len=3, eval_top_k=20, eval_input_key="question",
                         eval_label_key="answer")

    async def run():
        first = await manager.run_eval(cfg, 4, "5")
        again = await manager.run_eval(cfg, 4, "5")  # idempotent: the same result, nothing generated again
        num_requests = len(router.requests)
        later = await manager.run_eval(cfg, 9, "10")  # the next eval leases the same prompts again
        await manager.close()
        return first, again, num_requests, later

    first, again, num_requests, later = asyncio.run(run())
    assert first == again and num_requests == 12 and len(router.requests) == 24
    assert first == pytest.approx({
        "eval/math": (4 * 1 + (1 + 3 * 2) + 4 * 2) / 12,
        "eval/math-truncated_ratio": 7 / 12,
        "eval/math-pass@1": (1 + 1 / 4 + 0) / 3,
        "eval/math-pass@2": (1 + 1 / 2 + 0) / 3,
        "eval/math-pass@4": (1 + 1 + 0) / 3})
    body, _ = router.requests[0]
    assert body["rid"].startswith("job-eval4-")
    assert {k: body["sampling_params"][k] for k in ("temperature", "top_p", "max_new_tokens", "top_k")} == {
        "temperature": 0.3, "top_p": 0.5, "max_new_tokens": 3, "top_k": 20}
    eval_buffer = buffer.others["job.eval.math"]
    assert not eval_buffer.leased and len(eval_buffer.returned) == 3 and not buffer.groups  # eval writes nothing
    assert {s.label for s in eval_buffer.returned} == {"1", "2", "3"} and reward.calls


def test_each_eval_dataset_runs_with_its_own_settings(tiny_model_dir, tmp_path):
    """slime's eval_multi_task: each dataset its own samples per prompt, lengths, temperature, keys and reward type;
    the settings they share are the eval_* keys."""
    from services.rollout.client import config_from_proto, config_to_proto

    aime, gpqa = tmp_path / "aime.jsonl", tmp_path / "gpqa.jsonl"
    aime.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(2)))
    gpqa.write_text(json.dumps({"question": "A or B?", "answer": "A"}) + "\n")
    buffer, router = FakeBuffer(2), ScriptedRouter(script=lambda body, headers: reply([17], "1"))
    manager, reward = new_manager(buffer, router, tiny_model_dir)
    cfg = rollout_config(eval_prompt_data=[f"aime={aime}", f"gpqa={gpqa}"], eval_input_key="prompt",
                         eval_max_response_len=4, eval_top_p=0.7, eval_dataset_settings={
                             "aime": {"rm_type": "deepscaler", "n_samples_per_eval_prompt": 4},
                             "gpqa": {"rm_type": "gpqa", "n_samples_per_eval_prompt": 2, "temperature": 0.2,
                                      "max_response_len": 2, "input_key": "question", "label_key": "answer"}})
    cfg = config_from_proto(config_to_proto(cfg))  # as the manager gets it (a Struct: numbers come back as floats)

    async def run():
        metrics = await manager.run_eval(cfg, 3, "4")
        await manager.close()
        return metrics

    metrics = asyncio.run(run())
    assert set(metrics) == {"eval/aime", "eval/aime-truncated_ratio", "eval/aime-pass@1", "eval/aime-pass@2",
                            "eval/aime-pass@4", "eval/gpqa", "eval/gpqa-truncated_ratio", "eval/gpqa-pass@1",
                            "eval/gpqa-pass@2"}  # pass@k up to each dataset's own samples per prompt
    params = [body["sampling_params"] for body, _ in router.requests]
    assert len(params) == 2 * 4 + 1 * 2
    assert [(p["temperature"], p["top_p"], p["max_new_tokens"]) for p in params] == \
        [(0.7, 0.7, 4)] * 8 + [(0.2, 0.7, 2)] * 2  # aime: the rollout's temperature (no eval_temperature)
    assert [call["rm_type"] for call in reward.calls] == ["deepscaler", "gpqa"]  # each dataset scored at once
    assert [s.label for s in buffer.others["job.eval.gpqa"].returned] == ["A"]  # read by its own keys
