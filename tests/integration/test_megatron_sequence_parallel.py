"""Megatron's sequence parallelism on the megatron backend, over 2 gloo processes: at tensor parallelism 2 with
megatron.sequence_parallel (each TP rank normalizes, routes and runs its experts on a slice of the tokens, every row
padded to a multiple of 2), a dense Qwen3 and a Qwen3-MoE under a load-balancing loss give the log-probs and train
the GRPO steps of tensor parallelism 1, within 1e-5 in float32, packed and as padded rectangles; so does the MoE
under routing replay (each TP rank replays its slice of the tokens' experts, records are gathered over TP).

One launch of tests/integration/megatron_sp_worker.py serves the tests here."""

from __future__ import annotations

import json

import pytest

from tests.integration.workers import run_worker


@pytest.fixture(scope="module")
def results(tiny_model_dir, family_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-sp")
    run_worker("tests.integration.megatron_sp_worker", str(tiny_model_dir), str(family_model_dir("qwen3_moe")),
               str(out), log_path=out / "worker.log", timeout_s=420)
    return json.loads((out / "results.json").read_text())


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


@pytest.mark.parametrize("run", ["dense_tp2_packTrue", "dense_tp2_packFalse", "moe_tp2_packTrue",
                                 "moe_tp2_packFalse", "moe_tp2_ep2_packTrue", "rollout_replay_tp2_packTrue",
                                 "replay_tp2_ep2_packFalse"])
def test_sequence_parallel_trains_as_tensor_parallelism_1(results, run):
    got, want = results[run], results[run.replace("_tp2_", "_tp1_")]
    assert max_diff(got["log_probs_before"], want["log_probs_before"]) <= 1e-5
    if "replay" in run:  # the engine's other routing changes the log-probs
        assert max_diff(got["replayed_log_probs"], want["replayed_log_probs"]) <= 1e-5
        assert max_diff(got["replayed_log_probs"], got["log_probs_before"]) > 1e-3
    assert len(got["metrics"]) == len(want["metrics"]) == 2
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
        assert g.keys() == w.keys(), step
        for key in w:
            assert g[key] == pytest.approx(w[key], abs=1e-5, rel=1e-5), (step, key)
    assert abs(got["metrics"][1]["train/ppo_kl"]) > 1e-4  # the second step saw the policy the first one moved
    assert max_diff(got["log_probs_after"], want["log_probs_after"]) <= 1e-5


def test_the_moe_load_balancing_loss_counts_real_tokens_only(results):
    """Packed rows hold no padding, rectangles do: the routers weigh the same tokens either way."""
    packed, padded = results["moe_tp1_packTrue"], results["moe_tp1_packFalse"]
    for g, w in zip(padded["metrics"], packed["metrics"], strict=True):
        assert g["train/grad_norm"] == pytest.approx(w["train/grad_norm"], rel=1e-5)
    assert max_diff(padded["log_probs_after"], packed["log_probs_after"]) <= 1e-5
