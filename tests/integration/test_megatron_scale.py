"""Megatron features slime's large-model scripts use, on 2 gloo processes: the optimizer state offloaded to the host
(megatron-core's hybrid optimizer under the distributed optimizer, also overlapped and precision-aware) trains the
steps of the plain optimizer within 1e-6 and resumes exactly from its checkpoint; uneven pipeline stages (1+3 and
3+1 layers) train as one stage within 1e-5; every advantage estimator, and PPO with its critic (its value model,
GAE, value loss, critic-only first rollout) at DP=2, TP=2 and PP=2, train as the fsdp backend does on the same
model within 1e-5, and PPO resumes exactly from a checkpoint that holds the critic and its optimizer.

One launch of tests/integration/megatron_scale_worker.py serves every test here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.megatron_scale_worker import ESTIMATORS, estimator_config
from tests.integration.megatron_worker import grpo_rollout
from tests.integration.workers import run_worker


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron-scale")


@pytest.fixture(scope="module")
def results(out_dir) -> dict:
    run_worker("tests.integration.megatron_scale_worker", str(out_dir), log_path=out_dir / "worker.log",
               timeout_s=420)
    return json.loads((out_dir / "results.json").read_text())


def fsdp_run(model_dir: Path, config: dict, num_rollouts: int) -> dict:
    """The fsdp backend (one process) on the worker's model and rollouts: metrics, log-probs after, weights."""
    from services.trainer.backends.fsdp.backend import TorchBackend
    from services.trainer.settings.train import TrainConfig

    backend = TorchBackend(model_dir, TrainConfig(**config), num_threads=1)
    rollouts = [grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, r) for r in range(num_rollouts)]
    metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")}
               for rollout in rollouts for m in backend.train_rollout(rollout)]
    return {"metrics": metrics, "log_probs_after": backend.compute_log_probs(rollouts[0]),
            "weights": {k: v.tolist() for k, v in backend.named_weights()}}


@pytest.fixture(scope="module")
def fsdp_reference(results, out_dir) -> dict:
    model_dir = out_dir / "qwen3-2"
    runs = {estimator: fsdp_run(model_dir, estimator_config(estimator), 1) for estimator in ESTIMATORS}
    runs["ppo_two_rollouts"] = fsdp_run(model_dir, estimator_config("ppo", num_critic_only_steps=1), 2)
    return runs


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


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_advantage_estimator_trains_as_on_fsdp(results, fsdp_reference, estimator):
    got, want = results["estimators"][estimator], fsdp_reference[estimator]
    assert_same_steps(got["metrics"], want["metrics"], 1e-5)
    assert max_diff(got["log_probs_after"], want["log_probs_after"]) <= 1e-5
    assert max_weight_diff(got["weights"], want["weights"]) <= 1e-5
    if estimator == "ppo":
        assert {"train/value_loss", "train/value_clipfrac", "train/critic_grad_norm"} <= got["metrics"][0].keys()


@pytest.mark.parametrize("run", ["ppo_tp2", "ppo_pp2"])
def test_ppo_with_its_critic_trains_as_on_fsdp(results, fsdp_reference, run):
    got, want = results["ppo"][run], fsdp_reference["ppo_two_rollouts"]
    # the first rollout trains the critic alone (num_critic_only_steps 1), the second both
    assert set(got["metrics"][0]) == {"train/value_loss", "train/value_clipfrac", "train/critic_grad_norm"}
    assert {"train/pg_loss", "train/value_loss"} <= got["metrics"][2].keys()
    assert got["metrics"][0]["train/value_loss"] > 0 and got["metrics"][2]["train/critic_grad_norm"] > 0
    assert_same_steps(got["metrics"], want["metrics"], 1e-5)
    assert max_diff(got["log_probs_after"], want["log_probs_after"]) <= 1e-5
    assert max_weight_diff(got["weights"], want["weights"]) <= 1e-5


def test_ppo_resumes_its_critic_from_a_checkpoint(results):
    run = results["ppo"]["ppo_tp2"]
    assert run["resumed_parts"] == ["critic", "critic_optim", "model", "optim", "ref_model"]
    assert_same_steps(run["resumed_metrics"], run["metrics"][2:], 1e-7)
    assert max_weight_diff(run["resumed_weights"], run["weights"]) <= 1e-7
