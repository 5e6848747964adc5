"""Megatron features for models larger than a GPU, on 2 gloo processes: the optimizer state offloaded to the host
(megatron-core's hybrid optimizer under the distributed optimizer, also overlapped and precision-aware) trains the
steps of the plain optimizer within 1e-6 and resumes exactly from its checkpoint; uneven pipeline stages (1+3 and
3+1 layers) train as one stage within 1e-5.

One launch of tests/integration/megatron_scale_worker.py serves every test here.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.workers import run_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-scale")
    run_worker("tests.integration.megatron_scale_worker", str(out), log_path=out / "worker.log", timeout_s=420)
    return json.loads((out / "results.json").read_text())


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def assert_same_steps(got: list[dict], want: list[dict], tol: float) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), step
        for key in w:
            assert g[key] == pytest.approx(w[key], abs=tol, rel=tol), (step, key)


@pytest.mark.parametrize("run, plain", [("fp32_offload", "fp32"), ("fp32_offload_overlap", "fp32"),
                                        ("bf16_offload_precision_aware", "bf16")])
def test_offloaded_optimizer_trains_the_plain_optimizers_steps(results, run, plain):
    got, want = results["offload"][run], results["offload"][plain]
    # the state really is the hybrid optimizer's, in host copies of this rank's shard (19 tensors, 10 on rank 0)
    assert want["optimizer"] == {"class": "AdamW"}
    kind = got["optimizer"]
    assert kind["class"] == "HybridDeviceOptimizer" and not kind["gpu_optimizer"], kind
    assert 0 < kind["host_copies"] < 19 and kind["state_devices"] == ["cpu"], kind
    assert kind["cpu_optimizers"] == (kind["host_copies"] if "overlap" in run or "precision" in run else 1), kind
    assert len(got["metrics"]) == 4  # at least three steps, each moved by the one before
    assert got["metrics"][0]["train/grad_norm"] > 0 and abs(got["metrics"][3]["train/ppo_kl"]) > 1e-4
    assert_same_steps(got["metrics"], want["metrics"], 1e-6)
    assert max_weight_diff(got["weights"], want["weights"]) <= 1e-6
    assert max_diff(got["log_probs_after"], want["log_probs_after"]) <= 1e-6
    assert max_diff(got["log_probs_after"], got["log_probs_before"]) > 1e-4


def test_an_offloaded_optimizer_resumes_from_its_checkpoint(results):
    run = results["offload"]["fp32_offload_overlap"]
    assert_same_steps(run["resumed_metrics"], run["metrics"][2:], 1e-7)
    assert max_weight_diff(run["resumed_weights"], run["weights"]) <= 1e-7


@pytest.mark.parametrize("run, stages", [("pp2_first1", [1, 3]), ("pp2_last1", [3, 1])])
def test_uneven_pipeline_stages_train_as_one_stage(results, run, stages):
    got, want = results["pipeline"][run], results["pipeline"]["pp1"]
    assert got["stage_layers"] == stages and want["stage_layers"] == [4]
    assert max_diff(got["log_probs_before"], want["log_probs_before"]) <= 1e-5
    assert_same_steps(got["metrics"], want["metrics"], 1e-5)
    assert max_diff(got["log_probs_after"], want["log_probs_after"]) <= 1e-5
    assert max_weight_diff(got["weights"], want["weights"]) <= 1e-5
