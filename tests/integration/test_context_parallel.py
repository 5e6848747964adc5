"""Context parallelism on the fsdp backend trains exactly as one rank does: two ranks of one CP group (gloo), each
holding half of every sequence of packed micro-batches of unequal lengths (Megatron's load-balanced chunks), give
the per-token log-probs and entropy, a step's losses and metrics and every parameter's gradient (policy and PPO
critic) of the same rollout trained on one rank, within 1e-5 in float32.

One two-rank launch of tests/integration/cp_worker.py serves every test here.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.cp_worker import CASES
from tests.integration.workers import run_ranks

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("context-parallel")
    run_ranks("tests.integration.cp_worker", str(tiny_model_dir), str(out), log_dir=out, timeout_s=600)
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_context_parallel_equals_one_rank(results, case):
    diffs = results[case]
    assert diffs["log_probs"] <= TOLERANCE and diffs["entropy"] <= TOLERANCE, case
    assert diffs["metrics"] and max(diffs["metrics"].values()) <= TOLERANCE, (case, diffs["metrics"])
    worst = max(diffs["grads"], key=diffs["grads"].get)
    assert diffs["grads"][worst] <= TOLERANCE, (case, worst, diffs["grads"][worst])
    assert diffs["grad_scale"] > 1e-3, case  # live gradients, equal
    if case == "ppo":  # the critic trains under CP too
        assert any(name.startswith("critic.") for name in diffs["grads"])


def test_a_token_budget_counts_the_whole_group(results):
    # max_tokens_per_gpu 10 a rank: one rank packs 16, 14, 15 and 10 alone (a sequence over budget alone), then
    # 6+4 and 5+5; a CP group of two packs up to 20 tokens a micro-batch (half of each sequence, padded to a
    # multiple of 4, on each rank), slime's max_tokens_per_gpu × cp_size: 16+4, 15+5, 14+6, 10+5
    one, group = results["grpo_dynamic"]["micro_batches"]
    assert one == [16, 14, 15, 10, 10, 10]
    assert group == [20, 20, 20, 15]
