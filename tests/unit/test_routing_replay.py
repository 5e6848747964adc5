"""Routing replay on the torch backend (tiny Qwen3-MoE, 4 experts, top-2): replaying the routing a forward would
choose anyway changes nothing; replaying an engine's different routing changes the log-probs and the loss, with the
gate weights from the current router; packed and padded micro-batches keep each token's experts aligned."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from services.common.samples import Sample
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.batching.batch import build_rollout_batch
from services.trainer.moe.hf_routing_replay import RoutingReplay, moe_routers, replayed_gate
from services.trainer.settings.train import TrainConfig
from tests.tiny_samples import samples_of

ROLLOUT = [("12+34=", "46", 1.0), ("12+34=", "55", 0.0), ("1+2=", "3", 0.0), ("1+2=", "4", 1.0)]


@pytest.fixture(scope="module")
def model_dir(family_model_dir):
    return family_model_dir("qwen3_moe")


def hf_model(model_dir, router_noise: float = 0.0):
    """The checkpoint's model; with router_noise, its routers' weights moved by that much Gaussian noise (an engine
    whose routing differs from the trainer's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if router_noise:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, router in moe_routers(model):
                router.weight.add_(router_noise * torch.randn(router.weight.shape, generator=generator))
    return model


@torch.no_grad()
def routed_experts(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, layers, top-k]: the experts `model` routes each token to, as an engine reports them (the
    last token is never fed)."""
    replay = RoutingReplay(model, model.config.num_hidden_layers)
    with replay.recording() as recorded:
        model(input_ids=torch.tensor([tokens[:-1]]))
    return recorded[0]


def with_experts(samples: list[Sample], engine) -> list[Sample]:
    for sample in samples:
        sample.rollout_routed_experts = routed_experts(engine, sample.tokens).flatten().tolist()
    return samples


def backend(model_dir, pack: bool = True, **overrides) -> TorchBackend:
    config = TrainConfig(**{"n_samples_per_prompt": 2, "lr": 1e-3, "micro_batch_size": 4, **overrides})
    return TorchBackend(model_dir, config, num_threads=1, pack_sequences=pack)


def test_the_replayed_gate_is_the_routers_softmax_at_the_recorded_experts():
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0]])
    experts = torch.tensor([[3, 0]])  # not the router's own top-2 (1, 0)
    # Σ = e + e² + 1 + e⁻¹ = 11.4752; p3 = e⁻¹ / Σ = 0.032059, p0 = e / Σ = 0.236883; renormalized: 0.119203, 0.880797
    assert replayed_gate(logits, experts, normalize=False)[0].tolist() == pytest.approx([0.032059, 0.236883],
                                                                                         abs=1e-6)
    assert replayed_gate(logits, experts, normalize=True)[0].tolist() == pytest.approx([0.119203, 0.880797],
                                                                                        abs=1e-6)


def test_replaying_the_models_own_routing_changes_nothing(model_dir):
    plain = backend(model_dir, num_steps_per_rollout=2)
    baseline = plain.train_rollout(samples_of(model_dir, ROLLOUT))
    own = backend(model_dir, use_routing_replay=True, num_steps_per_rollout=2)
    r3 = backend(model_dir, use_rollout_routing_replay=True, num_steps_per_rollout=2)
    rollout = with_experts(samples_of(model_dir, ROLLOUT), hf_model(model_dir))  # the engine's weights: the same
    for replayed in (own.train_rollout(samples_of(model_dir, ROLLOUT)), r3.train_rollout(rollout)):
        for step, want in zip(replayed, baseline, strict=True):
            for key in ("train/pg_loss", "train/ppo_kl", "train/grad_norm"):
                assert step[key] == pytest.approx(want[key], abs=1e-6), key
    assert plain.routing is None and own.routing is not None


def test_replaying_an_engines_other_routing_changes_the_loss(model_dir):
    engine = hf_model(model_dir, router_noise=2.0)
    samples = with_experts(samples_of(model_dir, ROLLOUT), engine)
    own = [routed_experts(hf_model(model_dir), s.tokens) for s in samples]
    differ = sum(int((torch.tensor(s.rollout_routed_experts).view_as(o).sort(-1).values
                      != o.sort(-1).values).any(-1).sum()) for s, o in zip(samples, own, strict=True))
    assert differ > 0  # the engine routed some tokens elsewhere in some layer
    r3 = backend(model_dir, use_rollout_routing_replay=True)
    batch = build_rollout_batch(samples, routing_shape=(r3.routing.num_layers, r3.routing.top_k))
    with torch.no_grad():
        replayed = r3._log_probs(r3.model, batch)
        natural = r3._log_probs(r3.model, dataclasses.replace(batch, routed_experts=None))
    assert (replayed - natural).abs().max() > 1e-4
    (with_replay,) = r3.train_rollout(samples)
    (without,) = backend(model_dir).train_rollout(samples_of(model_dir, ROLLOUT))
    # one step reuses its own forward as the old policy (pg_loss is -mean(A) = 0 either way): the gradient differs
    assert abs(with_replay["train/grad_norm"] - without["train/grad_norm"]) > 1e-4
    # the routers still learn: the gate weights come from the current logits at the replayed experts
    before = [router.weight for _, router in moe_routers(hf_model(model_dir))]
    after = [router.weight.detach() for _, router in moe_routers(r3.model)]
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("pack", [True, False])
def test_each_token_replays_its_own_experts_in_packed_and_padded_rows(model_dir, pack):
    engine = hf_model(model_dir, router_noise=2.0)
    samples = with_experts(samples_of(model_dir, ROLLOUT), engine)
    r3 = backend(model_dir, use_rollout_routing_replay=True, pack=pack)
    batch = build_rollout_batch(samples, routing_shape=(r3.routing.num_layers, r3.routing.top_k))
    with torch.no_grad():
        got = r3._log_probs(r3.model, batch)
    reference = hf_model(model_dir)
    replay = RoutingReplay(reference, reference.config.num_hidden_layers)
    for i, sample in enumerate(samples):  # one sample alone, unpadded, replaying its own rows
        experts = torch.tensor(sample.rollout_routed_experts, dtype=torch.int32).view(-1, replay.num_layers,
                                                                                        replay.top_k)
        with torch.no_grad(), replay.replaying(torch.cat([experts, replay.empty(1)])):
            logits = reference(input_ids=torch.tensor([sample.tokens])).logits[0]
        log_softmax = torch.log_softmax(logits, dim=-1)
        want = [log_softmax[t - 1, sample.tokens[t]].item() for t in range(sample.prompt_length, len(sample.tokens))]
        assert got[i, :sample.response_length].tolist() == pytest.approx(want, abs=1e-5)


def test_samples_without_the_engines_experts_are_refused(model_dir):
    r3 = backend(model_dir, use_rollout_routing_replay=True)
    with pytest.raises(ValueError, match="sample 0 came without the engines' routed experts"):
        r3.train_rollout(samples_of(model_dir, ROLLOUT))
    samples = with_experts(samples_of(model_dir, ROLLOUT), hf_model(model_dir))
    samples[1].rollout_routed_experts = samples[1].rollout_routed_experts[:-2]
    with pytest.raises(ValueError, match="sample 1: rollout_routed_experts has"):
        r3.train_rollout(samples)


def test_a_sigmoid_routers_replayed_gate_is_its_sigmoid_at_the_recorded_experts():
    logits = torch.tensor([[0.0, math.log(3.0), -math.log(3.0), 0.0]])  # sigmoid: .5, .75, .25, .5
    experts = torch.tensor([[2, 0]])
    assert replayed_gate(logits, experts, normalize=False, sigmoid=True)[0].tolist() == pytest.approx([0.25, 0.5])
    # renormalized (1/3, 2/3), times GLM-4-MoE's routed_scaling_factor 2.5
    assert replayed_gate(logits, experts, normalize=True, sigmoid=True, scaling_factor=2.5)[0].tolist() == \
        pytest.approx([2.5 / 3, 5.0 / 3], abs=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_5_moe", "glm4_moe", "deepseek_v3"])
def test_each_family_replays_its_own_routing_exactly_and_other_routing_not(family_model_dir, family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_model_dir(family), dtype=torch.float32).eval()
    replay = RoutingReplay(model, model.config.get_text_config().num_hidden_layers)
    tokens = torch.tensor([[3, 5, 7, 9, 11, 13, 2, 4]])
    with replay.recording() as recorded:
        natural = model(input_ids=tokens).logits
    with replay.replaying(recorded[0]):
        assert torch.allclose(model(input_ids=tokens).logits, natural, rtol=0, atol=1e-6)
    other = recorded[0].clone()
    other[:, :, 0] = (other[:, :, 1] + 1) % 4  # a first expert that is not the token's second
    with replay.replaying(other):
        assert (model(input_ids=tokens).logits - natural).abs().max() > 1e-4


def test_a_family_whose_router_it_does_not_replay_is_refused(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from services.trainer.backends import capabilities

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)  # dense Qwen3
    with pytest.raises(ValueError, match="has no MoE router it replays"):
        RoutingReplay(model, model.config.num_hidden_layers)
    assert "routing replay: model family 'mixtral' is not one it applies to" in \
        capabilities.router_problem("routing replay", "fsdp", {"model_type": "mixtral"})
    qwen3_moe = {"model_type": "qwen3_moe", "num_experts": 4}
    assert capabilities.router_problem("routing replay", "megatron", qwen3_moe, tp_size=2) == ""
    assert capabilities.router_problem("routing replay", "megatron", qwen3_moe, tp_size=2, sequence_parallel=True) \
        == ""  # each TP rank replays its slice of the tokens (tests/integration/test_megatron_sequence_parallel.py)
    assert capabilities.router_problem("moe_aux_loss_coeff", "megatron", qwen3_moe, tp_size=2) == (
        "moe_aux_loss_coeff: train_backend megatron adds it to a MoE model at tensor_model_parallel_size 1 or under "
        "megatron.sequence_parallel (megatron-core's MoE layers train at TP > 1 only so), got "
        "tensor_model_parallel_size 2")
    for layout in ({"tp_size": 1}, {"tp_size": 2, "sequence_parallel": True}):
        assert capabilities.router_problem("moe_aux_loss_coeff", "megatron", qwen3_moe, **layout) == ""
    assert capabilities.router_problem("routing replay", "fsdp", {"model_type": "glm4_moe"}) == ""
