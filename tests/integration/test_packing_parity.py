"""Packed micro-batches train exactly as padded ones on both backends, on one rank and on two data-parallel ranks
(gloo): per-token log-probs and entropy, a step's losses and its full gradients within 1e-5 in float32; and over
two ranks every rank runs as many micro-batches, Megatron's dealt by tokens.

One launch of tests/integration/packing_worker.py (a world of one, then of two) serves every test here.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.packing_worker import CONFIGS
from tests.integration.workers import run_worker

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("packing")
    run_worker("tests.integration.packing_worker", str(tiny_model_dir), str(out), log_path=out / "worker.log",
               timeout_s=600)
    return {size: json.loads((out / f"results-{size}.json").read_text()) for size in (1, 2)}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_packed_equals_padded(results, world_size, backend, config):
    for rank, diffs in enumerate(results[world_size][config][backend]["diffs"]):
        what = f"{backend} {config}, world of {world_size}, rank {rank}"
        assert diffs["log_probs"] <= TOLERANCE and diffs["entropy"] <= TOLERANCE, what
        assert diffs["metrics"] and max(diffs["metrics"].values()) <= TOLERANCE, (what, diffs["metrics"])
        assert diffs["grads"] <= TOLERANCE and diffs["grad_scale"] > 1e-3, what  # live gradients, equal


def test_every_rank_runs_as_many_micro_batches(results):
    # the buffer's shares balance groups by tokens (groups of 30, 25, 10 and 10 tokens: 30 -> rank 0, 25 -> rank 1,
    # 10 -> rank 1, 10 -> rank 0), so rank 0 holds 16, 14, 6, 4 and rank 1 15, 10, 5, 5; each packs longest first
    # under the budget of 20: [16, 4], [14, 6] and [15, 5], [10, 5], two micro-batches each
    assert results[2]["grpo_dynamic"]["fsdp"]["micro_batches"] == [[20, 20], [20, 15]]
    # one rank packs all eight, longest first: [16, 4], [15, 5], [14, 6], [10, 5]
    assert results[1]["grpo_dynamic"]["fsdp"]["micro_batches"] == [[20, 20, 20, 15]]
    # Megatron packs the whole step the same way, then deals: 20 -> rank 0, 20 -> rank 1, 20 -> rank 0 (a tie goes
    # to the first), 15 -> rank 1: 40 and 35 tokens (a contiguous split of the samples: 55 and 20)
    assert results[2]["grpo_dynamic"]["megatron"]["micro_batches"] == [[20, 20], [20, 15]]
