"""Qwen3-MoE on the Megatron backend, over 2 gloo processes: megatron-core's MoE layers with expert parallelism
(EP=2) give the HF model's logits within 1e-5, and MegatronBackend, with every expert on each rank (EP=1) or two on
each (EP=2), at tensor parallelism 1 and 2 (the two ranks one TP group), trains the first four GRPO steps as
TorchBackend does, its HF export holding the same weights under transformers' names, and resumes from its
dist-checkpoint exactly. Under routing replay, at tensor parallelism 1 and 2, it routes and trains as TorchBackend
does.

One launch of tests/integration/megatron_moe_worker.py serves the tests here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.trainer.settings.train import TrainConfig
from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout
from tests.integration.megatron_moe_worker import (
    AUX_LOSS_COEFF,
    LOAD_BALANCING_CONFIG,
    NUM_ROLLOUTS,
    engine_routed,
)
from tests.integration.workers import run_worker


@pytest.fixture(scope="module")
def model_dir(family_model_dir) -> Path:
    return family_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def results(model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-moe")
    run_worker("tests.integration.megatron_moe_worker", str(model_dir), str(out), log_path=out / "worker.log",
               timeout_s=420)
    return {**json.loads((out / "results.json").read_text()), "out": out}


@pytest.fixture(scope="module")
def torch_reference(model_dir) -> dict:
    from services.trainer.backends.fsdp.backend import TorchBackend

    backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG), num_threads=1)
    rollouts = [grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, r) for r in range(NUM_ROLLOUTS)]
    before = backend.compute_log_probs(rollouts[0])
    metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")}
               for rollout in rollouts for m in backend.train_rollout(rollout)]
    return {"log_probs_before": before, "log_probs_after": backend.compute_log_probs(rollouts[0]),
            "metrics": metrics, "weights": dict(backend.named_weights())}


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def test_expert_parallel_moe_layers_give_the_hf_logits(results):
    assert results["ep2_max_abs_logit_diff"] <= 1e-5


LAYOUTS = ["ep1", "ep2", "tp2_ep1", "tp2_ep2"]  # expert parallelism 1 or 2, at tensor parallelism 1 or 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_steps_match_torch_backend_and_the_export_loads_in_transformers(results, torch_reference, layout):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, save_dir = results[f"grpo_{layout}"], results["out"] / layout / "hf"
    assert max_diff(run["log_probs_before"], torch_reference["log_probs_before"]) < 1e-5
    assert len(run["metrics"]) == len(torch_reference["metrics"]) == 2 * NUM_ROLLOUTS
    for step, (got, want) in enumerate(zip(run["metrics"], torch_reference["metrics"], strict=True)):
        assert got.keys() == want.keys(), step
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=2e-5, rel=1e-4), (step, key)
    assert abs(run["metrics"][1]["train/ppo_kl"]) > 1e-4  # the second step saw the policy the first one moved
    assert max_diff(run["log_probs_after"], torch_reference["log_probs_after"]) < 1e-4
    saved = load_file(save_dir / "model.safetensors")
    assert saved.keys() == torch_reference["weights"].keys()  # fused experts: the names the engines load
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    for name, weight in torch_reference["weights"].items():
        torch.testing.assert_close(saved[name], weight, atol=1e-4, rtol=0, msg=name)
    reloaded = AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32).state_dict()
    for name, weight in saved.items():
        assert torch.equal(reloaded[name], weight), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_backend_resumed_from_a_dist_checkpoint_trains_the_experts_as_if_never_stopped(results, layout):
    run = results[f"grpo_{layout}"]
    never_stopped = run["metrics"][2:]
    assert len(run["resumed_metrics"]) == len(never_stopped) == 2
    for got, want in zip(run["resumed_metrics"], never_stopped, strict=True):
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-6, rel=1e-6), key
    assert max_diff(run["resumed_log_probs_after"], run["log_probs_after"]) < 1e-6


@pytest.mark.parametrize("replay", [False, True])
def test_the_load_balancing_loss_trains_the_router_as_the_torch_backend_does(results, model_dir, replay):
    """Under routing replay too: both count the experts the router's own scores pick."""
    from services.trainer.backends.fsdp.backend import TorchBackend

    def torch_run(coeff: float) -> tuple[list[dict], list[list[float]]]:
        backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG, moe_aux_loss_coeff=coeff,
                                                      use_rollout_routing_replay=replay), num_threads=1)
        rollout = grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, 0)
        rollout = engine_routed(model_dir, rollout) if replay else rollout
        metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in backend.train_rollout(rollout)]
        return metrics, backend.compute_log_probs(rollout)

    want, want_after = torch_run(AUX_LOSS_COEFF)
    plain, plain_after = torch_run(0.0)
    got = results["grpo_aux_loss_replayed" if replay else "grpo_aux_loss"]
    for step, (m, w, p) in enumerate(zip(got["metrics"], want, plain, strict=True)):
        assert m["train/grad_norm"] == pytest.approx(w["train/grad_norm"], rel=1e-4), step
        assert abs(w["train/grad_norm"] - p["train/grad_norm"]) > 1e-3, step  # the loss is not negligible
    assert max_diff(got["log_probs_after"], want_after) < 1e-4
    assert max_diff(want_after, plain_after) > 1e-3


def test_the_sequence_load_balancing_loss_is_logged_and_trains_as_the_torch_backends(results, model_dir):
    """Each step one padded micro-batch of 4 rows: megatron-core's seq_aux_loss (PP=2) reports and trains what the
    fsdp backend's does, which differs from the micro-batch's aux_loss."""
    from services.trainer.backends.fsdp.backend import TorchBackend

    def torch_metrics(kind: str) -> list[dict]:
        backend = TorchBackend(model_dir, TrainConfig(**LOAD_BALANCING_CONFIG, moe_router_load_balancing_type=kind),
                               num_threads=1, pack_sequences=False)
        rollout = grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, 0)
        return backend.train_rollout(rollout)

    want, whole = torch_metrics("seq_aux_loss"), torch_metrics("aux_loss")
    got = results["grpo_seq_aux_loss"]["metrics"]
    for step, (m, w, a) in enumerate(zip(got, want, whole, strict=True)):
        assert m["train/moe_aux_loss"] == pytest.approx(w["train/moe_aux_loss"], abs=1e-5, rel=1e-5), step
        assert m["train/grad_norm"] == pytest.approx(w["train/grad_norm"], rel=1e-4), step
        assert abs(w["train/moe_aux_loss"] - a["train/moe_aux_loss"]) > 1e-3, step  # per row, not per micro-batch


def test_the_global_load_balancing_loss_counts_tokens_over_the_data_parallel_ranks(results, model_dir):
    """At EP=2 the two data-parallel ranks each run one micro-batch of the step: megatron-core's global_aux_loss
    (summed over the ranks' shares) is Megatron's aux_loss of all the step's real tokens at once, from the HF
    model's router logits (the first step's, before any update)."""
    from transformers import AutoModelForCausalLM

    from services.trainer.moe.load_balancing import load_balancing_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rollout = grpo_rollout(model.config.vocab_size, model.config.pad_token_id, 0)
    with torch.no_grad():
        per_sample = [model(torch.tensor([s.tokens]), output_router_logits=True).router_logits
                      for s in rollout[:LOAD_BALANCING_CONFIG["global_batch_size"]]]
    layers = [torch.cat([logits[layer] for logits in per_sample]) for layer in range(len(per_sample[0]))]
    want = load_balancing_loss(layers, top_k=model.config.num_experts_per_tok).item()
    got = results["grpo_global_aux_loss"]["metrics"][0]["train/moe_aux_loss"]
    assert got == pytest.approx(want, abs=1e-5, rel=1e-5)


@pytest.mark.parametrize("setting", ["use_rollout_routing_replay", "use_routing_replay"])
def test_routing_replay_routes_as_the_torch_backend_does(results, model_dir, setting):
    from services.trainer.backends.fsdp.backend import TorchBackend

    def torch_run(**overrides) -> tuple[list[dict], list[list[float]]]:
        backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG, **overrides), num_threads=1)
        rollout = engine_routed(model_dir, grpo_rollout(backend.model.config.vocab_size, backend.pad_token_id, 0))
        metrics = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in backend.train_rollout(rollout)]
        return metrics, backend.compute_log_probs(rollout)

    want, want_after = torch_run(**{setting: True})
    got = results[setting]
    for step, (m, w) in enumerate(zip(got["metrics"], want, strict=True)):
        for key in ("train/pg_loss", "train/ppo_kl", "train/grad_norm"):
            assert m[key] == pytest.approx(w[key], abs=2e-5, rel=1e-4), (step, key)
    assert max_diff(got["log_probs_after"], want_after) < 1e-4
    if setting == "use_rollout_routing_replay":  # the engine's other routing changed the training
        plain, plain_after = torch_run()
        assert abs(plain[0]["train/grad_norm"] - want[0]["train/grad_norm"]) > 1e-3


@pytest.mark.parametrize("run", ["use_rollout_routing_replay_tp2_ep1", "use_rollout_routing_replay_tp2_ep2",
                                 "use_routing_replay_tp2_ep2"])
def test_routing_replay_at_tensor_parallelism_2_routes_as_at_1(results, model_dir, run):
    from safetensors.torch import load_file

    from services.trainer.backends.fsdp.backend import TorchBackend

    setting = run.split("_tp2_")[0]
    got, tp1 = results[run], results[setting]
    assert max_diff(got["replayed_log_probs"], tp1["replayed_log_probs"]) <= 1e-5
    assert max_diff(got["own_log_probs"], tp1["own_log_probs"]) <= 1e-5
    for step, (m, w) in enumerate(zip(got["metrics"], tp1["metrics"], strict=True)):
        for key in ("train/pg_loss", "train/ppo_kl", "train/grad_norm"):
            assert m[key] == pytest.approx(w[key], abs=2e-5, rel=1e-4), (step, key)
    assert max_diff(got["log_probs_after"], tp1["log_probs_after"]) < 1e-5
    if setting == "use_rollout_routing_replay":  # the engine's other routing changes the log-probs and the step
        assert max_diff(got["replayed_log_probs"], got["own_log_probs"]) > 1e-3
        plain = results["grpo_ep2"]["metrics"][0]  # the same rollout's first step, routed by the policy's routers
        assert abs(got["metrics"][0]["train/grad_norm"] - plain["train/grad_norm"]) > 1e-3
    backend = TorchBackend(model_dir, TrainConfig(**GRPO_CONFIG, **{setting: True}), num_threads=1)
    backend.train_rollout(engine_routed(model_dir, grpo_rollout(backend.model.config.vocab_size,
                                                                backend.pad_token_id, 0)))
    want, saved = dict(backend.named_weights()), load_file(results["out"] / run / "model.safetensors")
    assert saved.keys() == want.keys()
    for name, weight in want.items():
        torch.testing.assert_close(saved[name], weight, atol=1e-4, rtol=0, msg=name)


def test_what_megatron_core_cannot_train_at_tensor_parallelism_2_is_refused_before_any_group_forms(model_dir):
    from services.common.errors import InvalidArgument
    from services.trainer.backends.megatron.backend import MegatronBackend

    with pytest.raises(InvalidArgument, match="moe_aux_loss_coeff: train_backend megatron adds it to a MoE model at "
                                              "tensor_model_parallel_size 1 or under megatron.sequence_parallel"):
        MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG, moe_aux_loss_coeff=0.1), tensor_model_parallel_size=2)
    with pytest.raises(InvalidArgument, match="megatron dropout: train_backend megatron adds it to a MoE model"):
        MegatronBackend(model_dir, TrainConfig(**GRPO_CONFIG), tensor_model_parallel_size=2,
                        megatron_args={"attention_dropout": 0.1})
