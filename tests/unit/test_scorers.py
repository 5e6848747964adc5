"""Reward scoring: built-in verifiers on hand cases, and user functions that succeed, fail, hang or misbehave."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import InvalidArgument
from services.common.samples import Sample, sample_to_proto
from services.reward import one_sample, scorers, verifiers
from services.reward.client import ScoreResult

PLUGINS = "tests.plugins.reward_fns"


def score(samples, *, rm_type="", custom_rm_path="", reward_key="", timeout_s=5.0, args=None, semaphore=None):
    async def run():
        return await scorers.score_samples(samples, rm_type=rm_type, custom_rm_path=custom_rm_path,
                                           reward_key=reward_key, timeout_s=timeout_s, args=args or {},
                                           semaphore=semaphore if semaphore is None else semaphore())
    return asyncio.run(run())


def test_exact_match():
    assert verifiers.exact_match("  46\n", "46 ") == 1.0
    assert verifiers.exact_match("46.0", "46") == 0.0
    assert verifiers.exact_match("Paris", "paris") == 0.0


def test_builtin_rm_type_through_score_samples():
    samples = [Sample(response=r"\boxed{46}", label="46"), Sample(response="45", label="46")]
    assert score(samples, rm_type="math") == [ScoreResult(1.0, True), ScoreResult(0.0, True)]
    assert [r.reward for r in score(samples, rm_type="exact_match")] == [0.0, 0.0]


def test_unknown_rm_type_lists_valid_names():
    with pytest.raises(InvalidArgument, match=r"unknown rm_type 'maths'; expected one of math, deepscaler, dapo"):
        score([Sample()], rm_type="maths")
    with pytest.raises(InvalidArgument, match="rm_type 'boxed_ifbench' is not supported: .*IFBench"):
        score([Sample()], rm_type="boxed_ifbench")


def test_empty_rm_type_fails_only_the_samples_whose_metadata_names_none():
    results = score([Sample(response=r"\boxed{4}", label="4", metadata={"rm_type": "math"}), Sample(index=1)])
    assert results[0] == ScoreResult(1.0, True)
    assert not results[1].ok and "sample 1: rm_type is not set" in results[1].error


def test_bad_timeout_is_invalid():
    for bad in (0, -1.0, float("nan"), float("inf"), 1e9):
        with pytest.raises(InvalidArgument, match=r"timeout_s must be in \(0, 3600\]"):
            score([Sample()], rm_type="math", timeout_s=bad)


def test_user_function_gets_args_and_sample():
    samples = [Sample(response="46", label="46"), Sample(response="4", label="46")]
    results = score(samples, custom_rm_path=f"{PLUGINS}.scaled_match", args={"scale": 2.5})
    assert results == [ScoreResult(2.5, True), ScoreResult(0.0, True)]


def test_user_function_raising_fails_only_its_sample():
    results = score([Sample(response="x")], custom_rm_path=f"{PLUGINS}.boom")
    assert results == [ScoreResult(0.0, False, f"custom_rm_path {PLUGINS}.boom: ValueError: cannot score 'x'")]


def test_user_function_timeout():
    start = time.monotonic()
    results = score([Sample(), Sample()], custom_rm_path=f"{PLUGINS}.slow", timeout_s=0.3, args={"sleep_s": 30})
    assert time.monotonic() - start < 25.0  # far below the functions' 30 s: they were stopped
    assert results == [ScoreResult(0.0, False, "timed out after 0.3 s (worker killed)")] * 2


def test_dict_result_with_reward_key():
    samples = [Sample(response="46", label="46"), Sample(response="45", label="46")]
    results = score(samples, custom_rm_path=f"{PLUGINS}.dapo_like", reward_key="score")
    # non-numeric values ("pred") stay out of `scores`; bools count as numbers
    assert results == [ScoreResult(1.0, True, "", {"score": 1.0, "acc": 1.0}),
                       ScoreResult(-1.0, True, "", {"score": -1.0, "acc": 0.0})]


def test_dict_result_without_usable_reward_key_fails_naming_the_keys():
    [missing] = score([Sample()], custom_rm_path=f"{PLUGINS}.dapo_like")
    assert not missing.ok and missing.reward == 0.0
    assert "set reward_key" in missing.error and "keys: acc, pred, score" in missing.error
    [wrong] = score([Sample()], custom_rm_path=f"{PLUGINS}.dapo_like", reward_key="reward")
    assert not wrong.ok and "reward_key 'reward' not in its result (keys: acc, pred, score)" in wrong.error
    [text] = score([Sample()], custom_rm_path=f"{PLUGINS}.dapo_like", reward_key="pred")
    assert not text.ok and "returned ''" in text.error


def test_non_numeric_result_fails():
    [result] = score([Sample()], custom_rm_path=f"{PLUGINS}.not_a_number")
    assert not result.ok and result.error.endswith("returned 'high'; expected a finite float or a dict of them")


@pytest.mark.parametrize("path, message", [
    (f"{PLUGINS}.sync_reward", "must be an async function"),
    (f"{PLUGINS}.one_param", "takes 1 positional parameters"),
    (f"{PLUGINS}.missing", "has no function 'missing'"),
    ("tests.plugins.no_such_module.reward", "cannot import module 'tests.plugins.no_such_module'"),
    ("reward", "is not an import path"),
    ("os.system", "'os.system' is not under an allowed plugin module"),
    ("services.reward.one_sample.call_scorer", "is not under an allowed plugin module"),
    ("testsXplugins.reward_fns.boom", "is not under an allowed plugin module"),
])
def test_unloadable_user_function_is_invalid(path, message):
    with pytest.raises(InvalidArgument, match=f"custom_rm_path: .*{message}"):
        score([Sample()], custom_rm_path=path)


def peak_overlap(results: list[ScoreResult]) -> int:
    """The most calls of `timed` that ran at once, from the start and end times they report."""
    events = sorted([(r.scores["start"], 1) for r in results] + [(r.scores["end"], -1) for r in results])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def test_concurrency_is_bounded_by_the_semaphore_and_the_workers():
    samples = [Sample(index=i) for i in range(6)]
    results = score(samples, custom_rm_path=f"{PLUGINS}.timed", reward_key="score", args={"sleep_s": 0.2},
                    semaphore=lambda: asyncio.Semaphore(2))
    assert [r.reward for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]   # in order
    assert 1 <= peak_overlap(results) <= 2
    results = score(samples, custom_rm_path=f"{PLUGINS}.timed", reward_key="score", args={"sleep_s": 0.2})
    assert 1 <= peak_overlap(results) <= scorers.shared_pool().num_workers


def test_proto_samples_score_like_the_dataclasses_they_encode():
    samples = [Sample(response="46", label="46", index=3), Sample(response="4", label="46", index=4)]
    protos = [sample_to_proto(s) for s in samples]  # what the gRPC server hands over, decoded in the worker
    for kwargs in ({"rm_type": "exact_match"}, {"custom_rm_path": f"{PLUGINS}.scaled_match", "args": {"scale": 2.5}}):
        assert score(protos, **kwargs) == score(samples, **kwargs)


def test_a_proto_sample_is_decoded_in_the_worker_with_its_whole_numbers_as_ints():
    sample = Sample(response="46", label={"answer": 46}, metadata={"bonus": 3, "weight": 0.5, "tags": [1, 2.5]})
    decoded = one_sample.as_sample(sample_to_proto(sample).SerializeToString())
    assert decoded.metadata == {"bonus": 3, "weight": 0.5, "tags": [1, 2.5]}
    assert type(decoded.metadata["bonus"]) is int and decoded.label == {"answer": 46}
    assert one_sample.as_sample(sample) is sample


def test_a_built_in_rule_gets_the_fields_it_reads_decoded_as_in_the_whole_sample():
    sample = Sample(prompt="1+2=", response="\\boxed{3}", label={"answer": 3}, index=7, tokens=[1, 2, 3],
                    metadata={"rm_type": "boxed_math", "bonus": 3}, rollout_log_probs=[-0.5])
    sent = sample_to_proto(sample).SerializeToString()
    light, whole = one_sample.as_sample(sent, whole=False), one_sample.as_sample(sent)
    for name in ("prompt", "response", "label", "metadata", "index"):  # what verifiers.score_builtin reads
        assert getattr(light, name) == getattr(whole, name) == getattr(sample, name), name
    assert type(light.metadata["bonus"]) is int
    assert whole.tokens == [1, 2, 3] and light.tokens == []  # the rest is left undecoded
    assert score([sample_to_proto(sample)], rm_type="math") == score([sample], rm_type="math")


def run_in_one_worker(tasks, timeout_s=5.0, pool=None):
    from services.reward.workers import WorkerPool

    async def run():
        return await pool.run_many(tasks, timeout_s)
    owned = pool is None
    pool = pool or WorkerPool(num_workers=1)
    try:
        return asyncio.run(run())
    finally:
        if owned:
            pool.close()


def match_task(response: str, index: int):
    from services.reward.workers import Task

    return Task("custom", f"{PLUGINS}.scaled_match", "", Sample(response=response, label="46", index=index),
                {"scale": 2.0}, index=index)


def test_a_run_of_samples_in_one_worker_keeps_each_samples_timeout_and_failures_its_own():
    from services.reward.workers import Task

    tasks = [match_task("46", 0),
             Task("custom", f"{PLUGINS}.slow", "", Sample(index=1), {"sleep_s": 30}, index=1),
             match_task("45", 2),
             Task("custom", f"{PLUGINS}.exits", "", Sample(index=3), {}, index=3),
             match_task("46", 4)]
    start = time.monotonic()
    outcomes = run_in_one_worker(tasks, timeout_s=1.0)
    assert time.monotonic() - start < 25.0  # the slow sample was stopped at its own timeout
    assert [(o.reward, o.ok) for o in outcomes] == [(2.0, True), (0.0, False), (0.0, True), (0.0, False),
                                                     (2.0, True)]
    assert outcomes[1].error == "timed out after 1 s (worker killed)"
    assert "SystemExit" in outcomes[3].error


def test_a_run_naming_unloadable_code_is_invalid_and_leaves_its_worker_answering_the_next_run_rightly():
    from services.reward.workers import Task, WorkerPool

    pool = WorkerPool(num_workers=1)
    try:
        bad = [Task("custom", f"{PLUGINS}.missing", "", Sample(index=i), {}, request_path=True, index=i)
               for i in range(3)]
        with pytest.raises(InvalidArgument, match="has no function 'missing'"):
            run_in_one_worker(bad, pool=pool)
        # the worker stopped the bad run at its first sample: no stale answer is read as the next run's
        outcomes = run_in_one_worker([match_task("46", 0), match_task("4", 1), match_task("46", 2)], pool=pool)
        assert [o.reward for o in outcomes] == [2.0, 0.0, 2.0]
    finally:
        pool.close()


def test_a_large_request_goes_out_in_runs_and_comes_back_in_order():
    assert [scorers.run_length(n, 4) for n in (1, 8, 31, 32, 256, 2048, 100_000)] == [1, 1, 1, 2, 16, 32, 32]
    samples = [Sample(response=str(i % 3), label="1", index=i) for i in range(100)]  # runs of 6 on 4 workers
    results = score([sample_to_proto(s) for s in samples], rm_type="exact_match")
    assert [r.reward for r in results] == [float(i % 3 == 1) for i in range(100)]
