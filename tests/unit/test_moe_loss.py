"""The MoE load-balancing loss: Megatron's aux_loss formula on hand-worked routings, softmax and sigmoid, and on the
torch backend (tiny Qwen3-MoE; GLM-4-MoE and DeepSeek-V3 for sigmoid routers) a step whose advantages are all 0
trains on moe_aux_loss_coeff × that loss alone, over the micro-batch's real tokens whether packed or padded."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.moe.load_balancing import (
    global_load_balancing_loss,
    load_balancing_loss,
    sequence_load_balancing_loss,
)
from services.trainer.settings.train import TrainConfig
from tests.tiny_samples import samples_of

LN3 = math.log(3.0)


def test_an_even_routing_costs_one_per_layer_and_a_skewed_one_more():
    # k = 1, two experts. Even: probs (.75, .25) -> expert 0 and (.25, .75) -> expert 1: P = (1, 1), c = (1, 1),
    # E / (k T²) Σ P c = 2 / 4 · 2 = 1.
    even = torch.tensor([[LN3, 0.0], [0.0, LN3]])
    assert load_balancing_loss([even], top_k=1).item() == pytest.approx(1.0, abs=1e-6)
    # Skewed: both tokens (.75, .25) -> expert 0: P = (1.5, .5), c = (2, 0): 2 / 4 · 3 = 1.5; two layers add up.
    skewed = torch.tensor([[LN3, 0.0], [LN3, 0.0]])
    assert load_balancing_loss([skewed], top_k=1).item() == pytest.approx(1.5, abs=1e-6)
    assert load_balancing_loss([even, skewed], top_k=1).item() == pytest.approx(2.5, abs=1e-6)
    # k = 2 of three experts, one token with probabilities (3, 1, 1) / 5 (logits ln 3, 0, 0) to expert 0 and one of
    # the tied others: P = (.6, .2, .2), c = (1, 1, 0) or (1, 0, 1): 3 / (2 · 1) · .8 = 1.2 either way.
    assert load_balancing_loss([torch.tensor([[LN3, 0.0, 0.0]])], top_k=2).item() == pytest.approx(1.2, abs=1e-6)


def test_the_sequence_and_global_losses_on_a_hand_worked_routing():
    # k = 1, two experts; tokens t1 = t3 = (.75, .25) -> expert 0, t2 = (.25, .75) -> expert 1.
    t1, t2 = [LN3, 0.0], [0.0, LN3]
    # seq_aux_loss, rows (t1, t2) and (t3, pad): T̄ = 3 real tokens / 2 rows = 1.5; row 0 P = (1, 1), c = (1, 1):
    # Σ P c = 2; row 1 P = (.75, .25), c = (1, 0): .75; 2 / (1 · 1.5²) · 2.75 / 2 rows = 11 / 9. The pad's logits
    # (expert 1's) weigh nothing.
    rows = torch.tensor([[t1, t2], [t1, [0.0, 9.0]]])
    valid = torch.tensor([[True, True], [True, False]])
    assert sequence_load_balancing_loss([rows], valid, top_k=1).item() == pytest.approx(11 / 9, abs=1e-6)
    assert sequence_load_balancing_loss([rows, rows], valid, top_k=1).item() == pytest.approx(22 / 9, abs=1e-6)
    # one row of all three is the micro-batch's aux_loss: P = (1.75, 1.25), c = (2, 1): 2 / 9 · 4.75
    whole = torch.tensor([[t1, t2, t1]])
    assert sequence_load_balancing_loss([whole], torch.ones(1, 3, dtype=torch.bool), top_k=1).item() == \
        pytest.approx(9.5 / 9, abs=1e-6) == load_balancing_loss([whole[0]], top_k=1).item()
    # global_aux_loss, micro-batches (t1, t2) then (t3): the first 2 / 4 · (1·1 + 1·1) = 1; the second weighs
    # P = (.75, .25) by the mean counts ((1, 1) + (1, 0)) / 2 = (1, .5) over T = 1: 2 · (.75 + .125) = 1.75
    first, second = global_load_balancing_loss([[torch.tensor([t1, t2])], [torch.tensor([t1])]], top_k=1)
    assert (first.item(), second.item()) == pytest.approx((1.0, 1.75), abs=1e-6)


def test_a_sigmoid_router_weighs_its_scores_normalized_over_the_experts():
    # k = 1, two experts; sigmoid(ln 3) = .75, sigmoid(0) = .5, so logits (ln 3, 0) score (.75, .5) / 1.25 = (.6, .4).
    # Even: (.6, .4) -> expert 0 and (.4, .6) -> expert 1: P = (1, 1), c = (1, 1): 2 / 4 · 2 = 1.
    even = torch.tensor([[LN3, 0.0], [0.0, LN3]])
    assert load_balancing_loss([even], top_k=1, score_function="sigmoid").item() == pytest.approx(1.0, abs=1e-6)
    # Skewed: both (.6, .4) -> expert 0: P = (1.2, .8), c = (2, 0): 2 / 4 · 2.4 = 1.2 (softmax's (.75, .25) gives 1.5,
    # unnormalized sigmoid's (.75, .5) 1.5 too).
    skewed = torch.tensor([[LN3, 0.0], [LN3, 0.0]])
    assert load_balancing_loss([skewed], top_k=1, score_function="sigmoid").item() == pytest.approx(1.2, abs=1e-6)
    # k = 2 of three experts, one token scoring sigmoid (.75, .5, .25) -> (1/2, 1/3, 1/6), to experts 0 and 1:
    # c = (1, 1, 0): 3 / (2 · 1) · (1/2 + 1/3) = 1.25.
    one = torch.tensor([[LN3, 0.0, -LN3]])
    assert load_balancing_loss([one], top_k=2, score_function="sigmoid").item() == pytest.approx(1.25, abs=1e-6)
    with pytest.raises(ValueError, match="score_function 'sinkhorn'"):
        load_balancing_loss([one], top_k=2, score_function="sinkhorn")


@pytest.mark.parametrize("pack", [True, False])
def test_the_backend_trains_on_the_load_balancing_loss(family_model_dir, pack):
    from transformers import AutoModelForCausalLM

    model_dir = family_model_dir("qwen3_moe")
    # equal rewards in each group: every advantage is 0, so the gradient is the load-balancing loss's alone
    samples = samples_of(model_dir, [("12+34=", "46", 1.0), ("12+34=", "55", 1.0), ("1+2=", "3", 0.0),
                                     ("1+2=", "4", 0.0)])
    coeff = 0.5
    config = TrainConfig(n_samples_per_prompt=2, lr=1e-3, micro_batch_size=4, moe_aux_loss_coeff=coeff)
    (metrics,) = TorchBackend(model_dir, config, num_threads=1, pack_sequences=pack).train_rollout(samples)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    per_sample = [reference(input_ids=torch.tensor([s.tokens]), output_router_logits=True).router_logits
                  for s in samples]
    layers = [torch.cat([logits[i] for logits in per_sample]) for i in range(len(per_sample[0]))]
    aux = load_balancing_loss(layers, top_k=reference.config.num_experts_per_tok)
    (coeff * aux).backward()
    grad_norm = torch.cat([p.grad.flatten() for p in reference.parameters() if p.grad is not None]).norm()
    assert metrics["train/moe_aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    assert 1.0 < aux.item() < 2.0 * len(layers)  # a random router is not perfectly even
    assert metrics["train/grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
    assert metrics["train/grad_norm"] > 0 and metrics["train/pg_loss"] == 0.0


def sigmoid_aux_loss(layers: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """megatron-core's aux_loss for a sigmoid router, written out: scores sigmoid(logits) / their sum over experts,
    the top-k of those scores counted (no expert bias), E / (k T²) Σ_e P_e c_e per layer."""
    total = torch.zeros(())
    for logits in layers:
        scores = torch.sigmoid(logits)
        scores = scores / scores.sum(dim=-1, keepdim=True)
        counts = torch.nn.functional.one_hot(scores.topk(top_k).indices, logits.shape[1]).sum(dim=(0, 1))
        total = total + logits.shape[1] / (top_k * logits.shape[0] ** 2) * (scores.sum(dim=0) * counts).sum()
    return total


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_the_backend_trains_a_sigmoid_router_on_megatrons_loss(family_model_dir, tmp_path, family):
    """The router's expert bias sends every token to expert 3; the loss counts the top-k of the unbiased scores
    (its weights scaled up, so that they score the experts far apart)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / family
    shutil.copytree(family_model_dir(family), model_dir)
    weights = load_file(model_dir / "model.safetensors")
    biases = [name for name in weights if name.endswith("e_score_correction_bias")]
    assert biases
    for name in biases:
        weights[name] = torch.tensor([0.0, 0.0, 0.0, 10.0])
        weights[name.replace("e_score_correction_bias", "weight")] *= 50.0
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    samples = samples_of(model_dir, [("12+34=", "46", 1.0), ("12+34=", "55", 1.0), ("1+2=", "3", 0.0),
                                     ("1+2=", "4", 0.0)])
    coeff = 0.5
    config = TrainConfig(n_samples_per_prompt=2, lr=1e-3, micro_batch_size=4, moe_aux_loss_coeff=coeff)
    (metrics,) = TorchBackend(model_dir, config, num_threads=1).train_rollout(samples)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = [reference(input_ids=torch.tensor([s.tokens]), output_router_logits=True) for s in samples]
    layers = [torch.cat([out.router_logits[i] for out in outputs]) for i in range(len(outputs[0].router_logits))]
    top_k = reference.config.num_experts_per_tok
    aux = sigmoid_aux_loss(layers, top_k)
    (coeff * aux).backward()
    grad_norm = torch.cat([p.grad.flatten() for p in reference.parameters() if p.grad is not None]).norm()
    assert metrics["train/moe_aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
    assert metrics["train/grad_norm"] > 0 and metrics["train/pg_loss"] == 0.0
    # counting the router's own (biased) choice, expert 3 for every token, would give another loss
    assert all((logits.topk(top_k).indices != 3).any() for logits in layers)


def test_no_coefficient_or_type_none_adds_nothing(family_model_dir):
    model_dir = family_model_dir("qwen3_moe")
    samples = samples_of(model_dir, [("12+34=", "46", 1.0), ("12+34=", "55", 1.0)])
    for overrides in ({}, {"moe_aux_loss_coeff": 0.5, "moe_router_load_balancing_type": "none"}):
        config = TrainConfig(n_samples_per_prompt=2, lr=1e-3, micro_batch_size=2, **overrides)
        (metrics,) = TorchBackend(model_dir, config, num_threads=1).train_rollout(samples)
        assert "train/moe_aux_loss" not in metrics and metrics["train/grad_norm"] == 0.0
    with pytest.raises(ValueError, match="moe_router_load_balancing_type"):
        TrainConfig(moe_router_load_balancing_type="sinkhorn")
