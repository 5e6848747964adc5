"""Context parallelism on megatron, over 4 gloo processes: at CP=2 (each rank holding chunks r and 2·CP-1-r of every
sequence, attention across the slices by the project's own CP attention) a tiny Qwen3 gives the log-probs, the
losses and every parameter's gradient of CP=1 within 1e-5, packed (THD) and as padded rectangles, at tensor
parallelism 1 and 2, also under sequence parallelism (each sequence padded to a multiple of 2·CP·TP); so does a tiny
Qwen3-MoE, and so does slime's train-inference mismatch example's mis.py, unchanged, as the TIS function; so does a
tiny DeepSeek-V3 (multi-latent attention, experts) training its MTP layer at TP 2 under sequence parallelism and CP 2,
the layout of slime's GLM-4.7-Flash script.

One launch of tests/integration/megatron_cp_worker.py serves the tests here."""

from __future__ import annotations

import json

import pytest
import torch

from testkit.mtp_checkpoints import build_tiny_deepseek_v3_with_mtp
from tests.integration.family_parity import max_diff
from tests.integration.workers import run_worker


@pytest.fixture(scope="module")
def results(tiny_model_dir, family_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-cp")
    mla = build_tiny_deepseek_v3_with_mtp(out / "deepseek-v3-mtp")
    run_worker("tests.integration.megatron_cp_worker", str(tiny_model_dir), str(family_model_dir("qwen3_moe")),
               str(mla), str(out), log_path=out / "worker.log", timeout_s=600)
    return json.loads((out / "results.json").read_text())


def max_tensor_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


@pytest.mark.parametrize("run, reference", [
    ("dense_tp1_cp2_packTrue", "dense_tp1_cp1_packTrue"),
    ("dense_tp1_cp2_packFalse", "dense_tp1_cp1_packFalse"),
    ("dense_tp2_cp2_packTrue", "dense_tp2_cp1_packTrue"),
    ("dense_tp2_cp2_packTrue", "dense_tp1_cp1_packTrue"),
    ("dense_tp2_cp2_sp_packTrue", "dense_tp1_cp1_packTrue"),
    ("dense_tp2_cp2_sp_packFalse", "dense_tp1_cp1_packFalse"),
    ("moe_tp1_cp2_packTrue", "moe_tp1_cp1_packTrue"),
    ("mis_tp1_cp2_packTrue", "mis_tp2_cp1_packTrue"),  # the same micro-batches (mis.py normalizes over each)
    ("mla_tp2_cp2_sp_packTrue", "mla_tp1_cp1_packTrue"),  # GLM-4.7-Flash's script's layout, its MTP layer trained
])
def test_context_parallelism_trains_as_one_rank_per_sequence(results, run, reference):
    got, want = results[run], results[reference]
    assert max_diff(got["log_probs_before"], want["log_probs_before"]) <= 1e-5
    assert len(got["metrics"]) == len(want["metrics"]) == 2
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
        assert g.keys() == w.keys(), step
        for key in w:
            assert g[key] == pytest.approx(w[key], abs=1e-5, rel=1e-5), (step, key)
    # every parameter's gradient of the last step, whole (HF names), nonzero
    assert len(want["grads"]) >= 24 and max_tensor_diff(got["grads"], want["grads"]) <= 1e-5
    assert all(torch.tensor(g).abs().max() > 0 for g in want["grads"].values())
    assert max_diff(got["log_probs_after"], want["log_probs_after"]) <= 1e-5
    # Adam divides each gradient by its own root mean square: on entries whose gradient is ~1e-8 a 1e-7 difference
    # moves the update by a good part of lr (1e-3), so the weights agree less closely than the gradients
    assert max_tensor_diff(got["weights"], want["weights"]) <= 1e-4


def test_slimes_mismatch_example_runs_at_context_parallelism_2(results):
    """mis.py's own metrics are in the steps' (slime's compute_mis_weights_with_cp ran on every step)."""
    for step in results["mis_tp1_cp2_packTrue"]["metrics"]:
        assert any("is_ratio_mean_final" in key for key in step), sorted(step)
