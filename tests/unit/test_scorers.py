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
