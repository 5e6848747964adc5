"""TorchBackend on the tiny model: micro-batching invariance, first-step invariants, learning, HF export."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.settings.train import TrainConfig
from tests.tiny_samples import samples_of

# (prompt, response, reward): two groups of n = 2, one rewarded response each.
ROLLOUT = [("1+2=", "3", 1.0), ("1+2=", "4", 0.0), ("12+34=", "46", 0.0), ("12+34=", "55", 1.0)]


@pytest.fixture
def samples(tiny_model_dir) -> list[Sample]:
    out = samples_of(tiny_model_dir, ROLLOUT)
    out[2].loss_mask = [1, 0, 1]  # a masked token in the middle
    return out


def make_backend(model_dir, **overrides) -> TorchBackend:
    config = TrainConfig(**{"n_samples_per_prompt": 2, "lr": 1e-3, **overrides})
    return TorchBackend(model_dir, config, num_threads=1)


def sequence_log_probs(backend: TorchBackend, samples: list[Sample]) -> list[float]:
    return [sum(lp) for lp in backend.compute_log_probs(samples)]


def test_log_probs_are_next_token_log_probs_at_the_rollout_temperature(tiny_model_dir, samples):
    backend = make_backend(tiny_model_dir, rollout_temperature=0.7, micro_batch_size=4)
    for sample, got in zip(samples, backend.compute_log_probs(samples), strict=True):
        with torch.no_grad():
            logits = backend.model(input_ids=torch.tensor([sample.tokens])).logits[0]
        log_softmax = torch.log_softmax(logits / 0.7, dim=-1)
        start = sample.prompt_length
        expected = [log_softmax[t - 1, sample.tokens[t]].item() for t in range(start, len(sample.tokens))]
        assert got == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("calculate_per_token_loss", [False, True])
def test_loss_and_gradients_do_not_depend_on_micro_batching(tiny_model_dir, samples, calculate_per_token_loss):
    results = []
    # one micro-batch, several, one sample each, and dynamic packing (samples of 6, 6, 9, 9 tokens)
    for batching in ({"micro_batch_size": 4}, {"micro_batch_size": 3}, {"micro_batch_size": 1},
                     {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 14}):
        backend = make_backend(tiny_model_dir, **batching, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01,
                               calculate_per_token_loss=calculate_per_token_loss)
        for s, log_probs in zip(samples, backend.compute_log_probs(samples), strict=True):
            s.rollout_log_probs = [lp + 0.01 for lp in log_probs]
        (metrics,) = backend.train_rollout(samples)
        grads = {name: p.grad.clone() for name, p in backend.model.named_parameters()}
        results.append((metrics, grads))
    (metrics, grads), others = results[0], results[1:]
    assert metrics["train/pg_loss"] != 0.0 and metrics["train/entropy_loss"] > 0.0
    assert metrics["train/train_rollout_logprob_abs_diff"] == pytest.approx(0.01, abs=1e-5)
    for other_metrics, other_grads in others:
        assert other_metrics.keys() == metrics.keys()
        for key, value in metrics.items():
            if not key.startswith("perf/"):  # timings
                assert other_metrics[key] == pytest.approx(value, abs=1e-6, rel=1e-5), key
        for name, grad in grads.items():
            torch.testing.assert_close(other_grads[name], grad, atol=1e-6, rtol=0)


def test_first_step_old_log_probs_equal_compute_log_probs(tiny_model_dir, samples):
    backend = make_backend(tiny_model_dir, micro_batch_size=2)
    for s, log_probs in zip(samples, backend.compute_log_probs(samples), strict=True):
        s.rollout_log_probs = log_probs
    (metrics,) = backend.train_rollout(samples)
    # the old log-probs recomputed inside the step are the ones compute_log_probs returned
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-7
    assert abs(metrics["train/ppo_kl"]) < 1e-7 and metrics["train/pg_clipfrac"] == 0.0
    assert "train/kl_loss" not in metrics and metrics["train/lr"] == 1e-3
    assert metrics["train/loss"] == pytest.approx(metrics["train/pg_loss"])
    assert backend.weight_version == 1


def test_grpo_steps_raise_the_log_prob_of_rewarded_responses(tiny_model_dir, samples):
    backend = make_backend(tiny_model_dir, global_batch_size=2)  # two optimizer steps per rollout
    before = sequence_log_probs(backend, samples)
    for _ in range(3):
        metrics = backend.train_rollout(samples)
        assert len(metrics) == 2
        assert abs(metrics[1]["train/ppo_kl"]) > 0  # the second step sees the policy the first one moved
    after = sequence_log_probs(backend, samples)
    for (_, _, reward), b, a in zip(ROLLOUT, before, after, strict=True):
        assert (a > b) if reward > 0 else (a < b), (reward, b, a)


def test_reference_stays_frozen_and_gradients_are_clipped(tiny_model_dir, samples):
    backend = make_backend(tiny_model_dir, use_kl_loss=True, clip_grad=1e-3)  # kl_loss_coef 0: metric only
    first, second = backend.train_rollout(samples)[0], backend.train_rollout(samples)[0]
    assert first["train/kl_loss"] == 0.0 and second["train/kl_loss"] != 0.0
    assert all(not p.requires_grad for p in backend.ref_model.parameters())
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in backend.model.parameters()]))
    assert second["train/grad_norm"] > 1e-2 and clipped.item() == pytest.approx(1e-3, rel=1e-3)


def test_sft_steps_lower_the_loss(tiny_model_dir, samples):
    backend = make_backend(tiny_model_dir, loss_type="sft_loss", micro_batch_size=2)
    losses = [backend.train_rollout(samples)[0] for _ in range(4)]
    assert {k for k in losses[0] if k.startswith("train/")} == {"train/loss", "train/grad_norm", "train/lr"}
    timings = {"perf/log_probs_seconds", "perf/forward_backward_seconds", "perf/optimizer_seconds"}
    assert timings <= set(losses[0]) and all(losses[0][k] >= 0 for k in timings)  # the step time breakdown
    assert losses[-1]["train/loss"] < losses[0]["train/loss"] - 0.1
    # the SFT loss is the mean over samples of each sample's mean NLL of its (unmasked) response tokens
    nll = [-sum(m * lp for m, lp in zip(s.loss_mask or [1] * s.response_length, lps, strict=True))
           / sum(s.loss_mask or [1] * s.response_length)
           for s, lps in zip(samples, backend.compute_log_probs(samples), strict=True)]
    assert backend.train_rollout(samples)[0]["train/loss"] == pytest.approx(sum(nll) / len(nll), rel=1e-5)


def test_save_hf_reloads_in_transformers_with_equal_weights(tiny_model_dir, samples, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = make_backend(tiny_model_dir, loss_type="sft_loss", micro_batch_size=4)
    backend.train_rollout(samples)
    backend.save_hf(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    weights = dict(backend.named_weights())
    assert set(reloaded) - set(weights) == {"lm_head.weight"}  # tied to the embeddings
    for name, tensor in weights.items():
        assert torch.equal(reloaded[name], tensor), name
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert not torch.equal(original["model.norm.weight"], weights["model.norm.weight"])  # it did train
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.decode(tokenizer.encode("12+34=")) == "12+34="
    # and the backend's own load() takes the export back
    fresh = make_backend(tiny_model_dir)
    fresh.load(tmp_path / "hf")
    assert all(torch.equal(t, weights[n]) for n, t in fresh.named_weights())


def test_named_weights_gives_every_weight_once_under_hf_names(tiny_model_dir):
    backend = make_backend(tiny_model_dir)
    names = [name for name, _ in backend.named_weights()]
    assert len(names) == len(set(names)) == len(list(backend.model.parameters()))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names


def test_rollout_smaller_than_a_step_is_rejected_and_a_partial_step_dropped(tiny_model_dir, samples, caplog):
    backend = make_backend(tiny_model_dir, global_batch_size=3, micro_batch_size=3)
    with caplog.at_level(logging.WARNING):
        assert len(backend.train_rollout(samples)) == 1
    assert "dropping the last 1 of 4 samples" in caplog.text
    with pytest.raises(InvalidArgument, match="rollout has 2 samples, fewer than global_batch_size 3"):
        backend.train_rollout(samples[:2])


def test_train_config_defaults_and_validation():
    config = TrainConfig(eps_clip=0.3)
    assert config.eps_clip_high == 0.3 and config.lr == 1e-6 and config.adam_beta2 == 0.999
    assert replace(config, eps_clip_high=0.5).eps_clip_high == 0.5
    for kwargs, message in [
        ({"loss_type": "value_loss"}, "loss_type must be one of policy_loss, sft_loss, custom_loss, got 'value_loss'"),
        ({"advantage_estimator": "rloo"}, "advantage_estimator must be one of grpo, gspo, cispo, ppo, "),
        ({"kl_loss_type": "k4"}, "kl_loss_type must be one of"),
        ({"micro_batch_size": 0}, "micro_batch_size must be >= 1, got 0"),
        ({"global_batch_size": 0}, "global_batch_size must be >= 1"),
        ({"rollout_temperature": 0.0}, "rollout_temperature must be > 0"),
        ({"eps_clip_high": -0.1}, "eps_clip_high must be >= 0"),
        ({"adam_beta2": 1.0}, r"adam_beta2 must be in \[0, 1\)"),
        ({"kl_loss_coef": 0.1}, "kl_loss_coef is 0.1 but use_kl_loss is false"),
        ({"use_kl_loss": True, "loss_type": "sft_loss"},
         "use_kl_loss applies to loss_type 'policy_loss' or 'custom_loss', not 'sft_loss'"),
    ]:
        with pytest.raises(ValueError, match=message):
            TrainConfig(**kwargs)
