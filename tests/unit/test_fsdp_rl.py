"""TorchBackend's RL path on the tiny model: every estimator end to end, micro-batching invariance of each loss,
first-step invariants, the PPO critic, custom and SFT losses, reward_key and the lr schedule."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.batching.batch import build_rollout_batch
from services.trainer.settings.train import TrainConfig
from tests.tiny_samples import samples_of

# (prompt, response, reward): two groups of n = 2; token counts 9, 9, 6, 6 (+1 eos on each response)
ROLLOUT = [("12+34=", "46", 1.0), ("12+34=", "55", 0.0), ("1+2=", "3", 0.0), ("1+2=", "4", 1.0)]
ESTIMATOR_CONFIGS = {
    "grpo": {},
    "gspo": {"advantage_estimator": "gspo"},
    "cispo": {"advantage_estimator": "cispo", "eps_clip": 1.0, "eps_clip_high": 4.0},
    "ppo": {"advantage_estimator": "ppo", "kl_coef": 0.05, "gamma": 0.9, "lambd": 0.8},
    "reinforce_plus_plus": {"advantage_estimator": "reinforce_plus_plus", "normalize_advantages": True,
                            "gamma": 0.9},
    "reinforce_plus_plus_baseline": {"advantage_estimator": "reinforce_plus_plus_baseline",
                                     "normalize_advantages": True, "kl_coef": 0.05},
}


@pytest.fixture
def samples(tiny_model_dir) -> list[Sample]:
    out = samples_of(tiny_model_dir, ROLLOUT)
    out[1].loss_mask = [1, 0, 1]  # a masked (tool) token in the middle
    return out


def make_backend(model_dir, **overrides) -> TorchBackend:
    config = TrainConfig(**{"n_samples_per_prompt": 2, "lr": 1e-3, "lr_decay_style": "constant", **overrides})
    return TorchBackend(model_dir, config, num_threads=1)


def with_rollout_log_probs(backend: TorchBackend, samples: list[Sample], shift: float = 0.0) -> list[Sample]:
    """The engines' log-probs: the backend's own, moved by -shift, 0, +shift on every third token."""
    for s, log_probs in zip(samples, backend.compute_log_probs(samples), strict=True):
        s.rollout_log_probs = [lp + shift * (t % 3 - 1) for t, lp in enumerate(log_probs)]
    return samples


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(ESTIMATOR_CONFIGS))
def test_every_estimator_trains_two_steps_per_rollout(tiny_model_dir, samples, name):
    backend = make_backend(tiny_model_dir, global_batch_size=2, **ESTIMATOR_CONFIGS[name])
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    metrics = backend.train_rollout(with_rollout_log_probs(backend, samples))
    assert len(metrics) == 2 and backend.weight_version == 1
    expected = {"train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/entropy_loss",
                "train/grad_norm", "train/lr", "train/train_rollout_logprob_abs_diff"}
    if name == "ppo":
        expected |= {"train/value_loss", "train/value_clipfrac", "train/critic_grad_norm"}
    for step in metrics:
        assert {k for k in step if not k.startswith("perf/")} == expected  # perf/: the step's timings
        assert all(math.isfinite(v) for v in step.values())
    assert metrics[0]["train/ppo_kl"] == 0.0 and metrics[1]["train/ppo_kl"] != 0.0  # the 2nd step sees a new policy
    assert any(not torch.equal(before[n], p) for n, p in backend.model.named_parameters())


BATCHINGS = ({"micro_batch_size": 4}, {"micro_batch_size": 3}, {"micro_batch_size": 1},
             {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 15})  # packs [[0, 2], [1, 3]]: 9 + 6 tokens


@pytest.mark.parametrize("name, extra", [
    ("gspo", {}), ("cispo", {}), ("ppo", {}), ("reinforce_plus_plus", {}),
    ("grpo", {"use_tis": True, "tis_clip": 1.005, "tis_clip_low": 0.995, "eps_clip_c": 3.0, "entropy_coef": 0.01}),
    ("grpo", {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl", "use_unbiased_kl": True,
              "calculate_per_token_loss": True}),
])
def test_loss_and_gradients_do_not_depend_on_micro_batching(tiny_model_dir, samples, name, extra):
    results = []
    for batching in BATCHINGS:
        backend = make_backend(tiny_model_dir, **ESTIMATOR_CONFIGS[name], **extra, **batching)
        with_rollout_log_probs(backend, samples, shift=0.01)
        (metrics,) = backend.train_rollout(samples)
        critic = grads(backend.critic.model) if backend.critic is not None else {}
        results.append((metrics, grads(backend.model), critic))
    (metrics, actor, critic), others = results[0], results[1:]
    assert sum(grad.abs().sum() for grad in actor.values()) > 0
    if "use_tis" in extra:
        assert 0 < metrics["train/tis_clipfrac"] < 1  # tis = e^0.01, 1, e^-0.01 against [0.995, 1.005]
    for other_metrics, other_actor, other_critic in others:
        assert other_metrics.keys() == metrics.keys()
        for key, value in metrics.items():
            if not key.startswith("perf/"):  # timings
                assert other_metrics[key] == pytest.approx(value, abs=1e-6, rel=1e-5), key
        for grads_a, grads_b in ((actor, other_actor), (critic, other_critic)):
            assert grads_a.keys() == grads_b.keys()
            for param, grad in grads_a.items():
                torch.testing.assert_close(grads_b[param], grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["grpo", "gspo"])  # gspo recomputes the old log-probs, grpo reuses its own
def test_first_step_log_probs_equal_the_reference_and_ppo_kl_is_zero(tiny_model_dir, samples, name):
    backend = make_backend(tiny_model_dir, **ESTIMATOR_CONFIGS[name], use_kl_loss=True, kl_loss_type="k2",
                           micro_batch_size=2)
    (metrics,) = backend.train_rollout(with_rollout_log_probs(backend, samples))
    assert metrics["train/kl_loss"] == 0.0  # k2 = Σ r²/2: every token's log-prob equals the reference's
    assert metrics["train/ppo_kl"] == 0.0 and metrics["train/pg_clipfrac"] == 0.0
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-6
    (second,) = backend.train_rollout(samples)
    assert second["train/kl_loss"] > 0.0


def test_ppo_trains_the_critic_alone_for_num_critic_only_steps(tiny_model_dir, samples):
    backend = make_backend(tiny_model_dir, advantage_estimator="ppo", num_critic_only_steps=1, micro_batch_size=2)
    policy = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    head = backend.critic.model.value_head.weight.detach().clone()
    (first,) = backend.train_rollout(samples)
    assert {k for k in first if not k.startswith("perf/")} == {"train/value_loss", "train/value_clipfrac",
                                                                "train/critic_grad_norm"}
    assert all(torch.equal(policy[n], p) for n, p in backend.model.named_parameters())  # the actor did not move
    assert not torch.equal(head, backend.critic.model.value_head.weight)
    losses = [first["train/value_loss"]] + [backend.train_rollout(samples)[0]["train/value_loss"] for _ in range(4)]
    assert losses[-1] < losses[0]  # the critic fits the returns
    assert backend.weight_version == 5


def test_a_custom_loss_with_the_wrong_signature_fails_when_the_backend_loads_it(tiny_model_dir):
    with pytest.raises(InvalidArgument, match=r"takes 2 positional parameters; expected def fn\(args, batch, logits, "
                                              r"sum_of_sample_mean\)"):
        make_backend(tiny_model_dir, loss_type="custom_loss",
                     custom_loss_function_path="tests.plugins.loss_fns.two_args")


def test_critic_values_are_not_temperature_scaled(tiny_model_dir, samples):
    batch = build_rollout_batch(samples)
    values = [make_backend(tiny_model_dir, advantage_estimator="ppo", rollout_temperature=t).critic.values(batch)
              for t in (1.0, 0.25)]
    assert torch.equal(values[0], values[1]) and values[0].shape == batch.loss_masks.shape


def test_custom_loss_function_gets_slimes_signature(tiny_model_dir, samples):
    results = []
    for overrides in ({"loss_type": "sft_loss"},
                      {"loss_type": "custom_loss", "custom_loss_function_path": "tests.plugins.loss_fns.mean_nll"}):
        backend = make_backend(tiny_model_dir, micro_batch_size=3, rollout_temperature=0.7, **overrides)
        (metrics,) = backend.train_rollout(samples)
        results.append((metrics, grads(backend.model)))
    (sft, sft_grads), (custom, custom_grads) = results
    assert custom["train/loss"] == pytest.approx(sft["train/loss"], abs=1e-6)  # the same masked mean NLL
    assert custom["train/nll"] == pytest.approx(custom["train/loss"])
    for param, grad in sft_grads.items():
        torch.testing.assert_close(custom_grads[param], grad, atol=1e-6, rtol=0)


def test_reward_key_picks_the_trained_reward(tiny_model_dir, samples):
    for s, score in zip(samples, (1.0, 0.0, 0.0, 1.0), strict=True):
        s.reward, s.reward_scores = 0.0, {"acc": score}
    raw = {"disable_rewards_normalization": True, "micro_batch_size": 4}
    (keyed,) = make_backend(tiny_model_dir, reward_key="acc", **raw).train_rollout(samples)
    (plain,) = make_backend(tiny_model_dir, **raw).train_rollout(samples)
    assert keyed["train/pg_loss"] == pytest.approx(-0.5)  # on policy: -mean of the raw rewards [1, 0, 0, 1]
    assert plain["train/pg_loss"] == 0.0


def test_lr_schedule_is_applied_per_optimizer_step(tiny_model_dir, samples):
    backend = make_backend(tiny_model_dir, lr_warmup_iters=1, lr_decay_style="linear", lr_decay_iters=3,
                           global_batch_size=2, micro_batch_size=2)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    first = backend.train_rollout(samples)
    assert [m["train/lr"] for m in first] == [0.0, 1e-3]  # warmup from 0, then the peak
    second = backend.train_rollout(samples)
    assert [m["train/lr"] for m in second] == pytest.approx([5e-4, 0.0])  # linear decay to min_lr at step 3
    assert backend.optimizer.param_groups[0]["num_steps"] == 4
    fresh = make_backend(tiny_model_dir, lr_warmup_iters=2, lr_decay_style="constant", global_batch_size=4)
    fresh.train_rollout(samples)  # its only step has lr 0: nothing moves
    assert all(torch.equal(before[n], p) for n, p in fresh.model.named_parameters())
