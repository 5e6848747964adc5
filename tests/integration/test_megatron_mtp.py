"""Multi-token prediction on megatron, over 2 gloo processes: a tiny MiMo (a Qwen2 with MiMo's `model.mtp_layers.*`,
testkit/mtp_checkpoints.py) trained with its MTP layers (megatron-core's MTP block) reports each depth's MTP loss
equal to the one computed by hand with plain torch over transformers' Qwen2 modules (1e-5), packed with the fused
head, padded with the full logits and at TP 2 under sequence parallelism, also with two depths; the policy's own
numbers are those of a run without MTP layers; the MTP loss trains the MTP layers and, through their input, the
decoder; MTP layers built but not trained come back in the HF export exactly as the checkpoint has them; a backend
resumed from a dist-checkpoint (the MTP layers and their optimizer state in it) trains as if never stopped. At two
pipeline stages (the MTP layers on the last, with its own copy of the embedding) a step and the weights after it are
those at one stage, with untied and with tied embeddings and with uneven stages (2 + 1 decoder layers), and a resumed
run trains as if never stopped; so are they at
context parallel size 2, packed and padded, and for the DeepSeek-V3 (multi-latent attention) too. A tiny
DeepSeek-V3's MTP layer (multi-latent attention and experts, under DeepSeek's names) trains at TP 2 under routing
replay (of the decoder's routers) and comes back in the export. Qwen3-Next's and Qwen3.5's MTP layer (`mtp.*`, a
full-attention layer after the gated delta-nets, zero-centered norms) reports the loss computed by hand over
transformers' modules of the family (Qwen3.5 at TP 2) and comes back in the export under its names.

One launch of tests/integration/megatron_mtp_worker.py serves the tests here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from testkit.grpo_rollout import GRPO_CONFIG, grpo_rollout
from testkit.mtp_checkpoints import (
    build_tiny_deepseek_v3_with_mtp,
    build_tiny_mimo,
    build_tiny_qwen_next_with_mtp,
    mtp_losses,
)
from tests.integration.workers import run_worker

VOCAB, PAD = 300, 0  # the tiny MiMo's vocabulary; Qwen2Config has no pad_token_id (the backend's default 0)
POLICY_METRICS = ("train/pg_loss", "train/entropy_loss", "train/kl_loss", "train/tis")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("mimo")
    return {"one": build_tiny_mimo(out / "one", 1), "two": build_tiny_mimo(out / "two", 2),
            "deepseek": build_tiny_deepseek_v3_with_mtp(out / "deepseek"),
            "tied": build_tiny_mimo(out / "tied", 1, tied=True),
            "three": build_tiny_mimo(out / "three", 1, num_layers=3),
            "qwen3_next": build_tiny_qwen_next_with_mtp(out / "qwen3_next", "qwen3_next"),
            "qwen3_5": build_tiny_qwen_next_with_mtp(out / "qwen3_5", "qwen3_5")}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-mtp")
    run_worker("tests.integration.megatron_mtp_worker", str(models["one"].parent), str(out),
               log_path=out / "worker.log", timeout_s=600)
    return json.loads((out / "results.json").read_text())


def first_step_sequences() -> list[tuple[list[int], list[float]]]:
    """The rollout's first step (global_batch_size samples): tokens and response loss masks."""
    rollout = grpo_rollout(VOCAB, PAD, 0)[:GRPO_CONFIG["global_batch_size"]]
    return [(s.tokens, s.loss_mask or [1.0] * s.response_length) for s in rollout]


def mtp_tensors(weights: dict) -> dict[str, torch.Tensor]:
    return {name: torch.as_tensor(value) for name, value in weights.items() if ".mtp_layers." in name}


@pytest.mark.parametrize(("run", "model"), [("dp2", "one"), ("dp2_padded_unfused", "one"), ("tp2_sp", "one"),
                                           ("pp2", "one"), ("pp2_tied", "tied"), ("cp2", "one"),
                                           ("cp2_padded", "one"), ("qwen3_next", "qwen3_next"),
                                           ("qwen3_5_tp2", "qwen3_5")])
def test_the_mtp_loss_is_the_hand_computed_one(results, models, run, model):
    expected = mtp_losses(models[model], first_step_sequences())
    step = results[run]["metrics"][0]
    assert step["train/mtp_1_loss"] == pytest.approx(expected[0], abs=1e-5)
    assert step["train/mtp_loss"] == pytest.approx(expected[0], abs=1e-5)


def test_two_depths_each_report_their_own_loss(results, models):
    expected = mtp_losses(models["two"], first_step_sequences(), num_layers=2)
    step = results["two_depths"]["metrics"][0]
    assert expected[0] != pytest.approx(expected[1], abs=1e-3)
    assert [step["train/mtp_1_loss"], step["train/mtp_2_loss"]] == pytest.approx(expected, abs=1e-5)
    assert step["train/mtp_loss"] == pytest.approx(sum(expected), abs=1e-5)


@pytest.mark.parametrize("run", ["dp2", "tp2_sp", "carried"])
def test_the_policy_loss_is_that_of_the_model_without_mtp_layers(results, run):
    plain, first = results["plain"]["metrics"][0], results[run]["metrics"][0]
    for key in POLICY_METRICS:
        assert first[key] == pytest.approx(plain[key], abs=1e-5), key
    assert torch.allclose(torch.tensor(results[run]["log_probs_before"][0]),
                          torch.tensor(results["plain"]["log_probs_before"][0]), atol=1e-5)


def test_the_mtp_loss_trains_the_mtp_layers_and_the_decoder(results, models):
    checkpoint = mtp_tensors(load_file(models["one"] / "model.safetensors"))
    trained = mtp_tensors(results["dp2"]["weights"])
    assert trained.keys() == checkpoint.keys()
    assert all(not torch.equal(trained[name], checkpoint[name]) for name in checkpoint)
    # the decoder's weights feed the MTP layers: its step differs from a step on the policy loss alone
    after, plain_after = (torch.tensor(results[run]["log_probs_after"][0]) for run in ("dp2", "plain"))
    assert (after - plain_after).abs().max() > 1e-4


def test_untrained_mtp_layers_come_back_as_the_checkpoint_has_them(results, models):
    checkpoint = mtp_tensors(load_file(models["one"] / "model.safetensors"))
    exported = mtp_tensors(results["carried"]["weights"])
    assert exported.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(exported[name], tensor), name
    assert "train/mtp_loss" not in results["carried"]["metrics"][0]
    # and the policy trained as it does without them
    assert torch.allclose(torch.tensor(results["carried"]["log_probs_after"][0]),
                          torch.tensor(results["plain"]["log_probs_after"][0]), atol=1e-6)


@pytest.mark.parametrize("name", ["tp2_sp", "pp2"])
def test_a_backend_resumed_from_a_dist_checkpoint_trains_the_mtp_layers_as_if_never_stopped(results, name):
    run = results[name]
    assert [m["train/mtp_loss"] for m in run["resumed"]] == pytest.approx([m["train/mtp_loss"] for m in run["second"]],
                                                                           abs=1e-6)
    assert [m["train/grad_norm"] for m in run["resumed"]] == pytest.approx(
        [m["train/grad_norm"] for m in run["second"]], abs=1e-6)


@pytest.mark.parametrize(("run", "reference"), [
    ("pp2", "dp2"), ("pp2_tied", "dp2_tied"), ("pp2_uneven", "dp2_three"), ("cp2", "dp2"), ("cp2_padded", "dp2"),
    ("deepseek_cp2", "deepseek_dp2")])
def test_at_two_pipeline_stages_or_context_slices_the_mtp_layers_train_as_at_one(results, run, reference):
    """PP 2: the MTP layers on the last stage embed with its copy of the embedding, whose gradient joins the first
    stage's. CP 2: each rank's MTP layers take its slices, the next tokens rolled across the group. Every step's
    losses and gradient norm, the log-probs after and every exported weight are those at size 1."""
    for step, expected in zip(results[run]["metrics"], results[reference]["metrics"], strict=True):
        for key in ("train/mtp_loss", "train/mtp_1_loss", "train/grad_norm", *POLICY_METRICS):
            assert step[key] == pytest.approx(expected[key], abs=1e-5), key
    assert torch.allclose(torch.tensor(results[run]["log_probs_after"][0]),
                          torch.tensor(results[reference]["log_probs_after"][0]), atol=1e-5)
    weights, expected = results[run]["weights"], results[reference]["weights"]
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.allclose(torch.tensor(weights[name]), torch.tensor(tensor), atol=1e-5), name


def test_a_deepseek_v3_mtp_layer_trains_and_comes_back_under_deepseeks_names(results, models):
    assert all(m["train/mtp_loss"] > 0 for m in results["deepseek_tp2"]["metrics"])
    checkpoint = load_file(models["deepseek"] / "model.safetensors")
    prefix = "model.layers.2."  # the tiny model's 2 decoder layers, then its MTP layer
    exported = {name: torch.as_tensor(value) for name, value in results["deepseek_carried"]["weights"].items()
                if name.startswith(prefix)}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight", "mlp.shared_experts.down_proj.weight"):
        assert torch.equal(exported[prefix + name], checkpoint[prefix + name]), name
    # the experts under transformers' fused names, as the decoder layers' are written
    gate_up = torch.stack([torch.cat([checkpoint[f"{prefix}mlp.experts.{e}.gate_proj.weight"],
                                      checkpoint[f"{prefix}mlp.experts.{e}.up_proj.weight"]]) for e in range(4)])
    assert torch.equal(exported[prefix + "mlp.experts.gate_up_proj"], gate_up)
    trained = {name: torch.as_tensor(value) for name, value in results["deepseek_tp2"]["weights"].items()
               if name.startswith(prefix)}
    assert not torch.equal(trained[prefix + "eh_proj.weight"], checkpoint[prefix + "eh_proj.weight"])


def test_a_qwen3_next_mtp_layer_comes_back_under_its_names(results, models):
    """Qwen3-Next's mtp.fc, mtp's three norms and mtp.layers.0 (a full-attention MoE layer) through megatron and back
    as the checkpoint holds them; trained, they change."""
    checkpoint = {name: t for name, t in load_file(models["qwen3_next"] / "model.safetensors").items()
                  if name.startswith("mtp.")}
    carried, trained = ({name: torch.as_tensor(value) for name, value in results[run]["weights"].items()
                         if name.startswith("mtp.")} for run in ("qwen3_next_carried", "qwen3_next"))
    assert carried.keys() == trained.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(carried[name], tensor), name
    for name in ("mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"):
        assert not torch.equal(trained[name], checkpoint[name]), name
