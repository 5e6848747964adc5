"""On-policy distillation on the Megatron backend (opd_type megatron): the teacher model loads from an HF directory
and from a checkpoint root, its log-probs are the HF teacher's own forward, and a rollout trains with the reverse-KL
term. One launch of tests/integration/megatron_opd_worker.py (one gloo rank)."""

from __future__ import annotations

import json
import math

import pytest

from tests.integration.workers import run_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-opd")
    run_worker("tests.integration.megatron_opd_worker", str(out), log_path=out / "worker.log", timeout_s=300)
    return json.loads((out / "results.json").read_text())


def flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def test_the_teacher_model_is_the_hf_teachers_forward_from_either_source(results):
    assert flat(results["before"]) == pytest.approx(flat(results["student_hf"]), abs=1e-4)  # a copy until loaded
    assert flat(results["from_hf"]) == pytest.approx(flat(results["teacher_hf"]), abs=1e-4)
    assert flat(results["from_checkpoint"]) == pytest.approx(flat(results["teacher_hf"]), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(flat(results["teacher_hf"]), flat(results["student_hf"]), strict=True)) > 0.1


def test_a_rollout_trains_with_the_reverse_kl_to_the_teacher(results):
    steps = results["metrics"]
    assert len(steps) == 2 and all(math.isfinite(m["train/loss"]) for m in steps)
    assert all(math.isfinite(m["train/opd_reverse_kl"]) and m["train/opd_reverse_kl"] != 0 for m in steps)
