"""slime's torch_dist checkpoints on the Megatron backend: written by megatron-core's own dist_checkpointing.save in
slime's layout (`release` and `iter_0000003`, an argparse Namespace in the common state that is never unpickled),
read as --ref-load, --opd-teacher-load and --load, and converted to an HF directory; each loaded model's log-probs
are the HF weights' own. One launch of tests/integration/megatron_slime_ckpt_worker.py (one gloo rank)."""

from __future__ import annotations

import json
import math

import pytest

from tests.integration.workers import run_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-slime-ckpt")
    run_worker("tests.integration.megatron_slime_ckpt_worker", str(out), log_path=out / "worker.log", timeout_s=300)
    return json.loads((out / "results.json").read_text())


def flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def test_slimes_checkpoints_load_as_reference_teacher_and_policy(results):
    teacher = pytest.approx(flat(results["teacher_hf"]), abs=1e-4)
    assert flat(results["ref"]) == teacher  # --ref-load X_torch_dist (release)
    assert flat(results["teacher"]) == teacher  # --opd-teacher-load (iter_0000003)
    assert flat(results["policy_before"]) == pytest.approx(flat(results["student_hf"]), abs=1e-4)
    assert flat(results["policy_after"]) == teacher  # --load: the weights
    assert all(math.isfinite(m["train/loss"]) for m in results["metrics"])


def test_the_conversion_to_hf_gives_the_checkpoints_weights(results):
    """train_backend fsdp reads slime's checkpoints through an HF directory that slime_to_hf writes."""
    assert flat(results["converted_hf"]) == pytest.approx(flat(results["teacher_hf"]), abs=1e-5)
