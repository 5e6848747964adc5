"""slime's trainer-side hooks (tests/plugins/slime_hooks.py) called with slime's signatures: the reward
post-process, the advantage function and the TIS function, with their numbers derived by hand; their flags at
submit; and the three together in a training step of the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.algorithms.advantages import normalize_advantages
from services.trainer.api.spec import parse_spec
from services.trainer.batching.batch import build_rollout_batch
from services.trainer.settings.train import TrainConfig
from services.trainer.step import rl_step
from tests.tiny_samples import samples_of

HOOKS = "tests.plugins.slime_hooks"


def two_by_two() -> list[Sample]:
    """Two prompts × two samples, rewards 1, 0 | 0, 2; sample 2 has a masked (tool) token in the middle; the
    engines' log-probs are all -0.5."""
    return [Sample(tokens=[1, 2, 3, 4], response_length=2, reward=1.0, rollout_log_probs=[-0.5, -0.5]),
            Sample(tokens=[1, 2, 5], response_length=1, reward=0.0, rollout_log_probs=[-0.5]),
            Sample(tokens=[1, 6, 7, 8], response_length=3, reward=0.0, loss_mask=[1, 0, 1],
                   rollout_log_probs=[-0.5, -0.5, -0.5]),
            Sample(tokens=[1, 6, 9], response_length=2, reward=2.0, rollout_log_probs=[-0.5, -0.5])]


def test_reward_post_process_replaces_the_group_baseline():
    samples = two_by_two()
    for sample in samples:  # a reward function that returns dicts, as with slime's --reward-key
        sample.reward_scores = {"score": sample.reward, "acc": 1.0}
    config = TrainConfig(n_samples_per_prompt=2, reward_key="score",
                         custom_reward_post_process_path=f"{HOOKS}.center_rewards")
    batch = rl_step.compute_advantages_and_returns(build_rollout_batch(samples, reward_key="score"), config,
                                                   samples=samples)
    # rewards 1, 0, 0, 2 (the dict's "score", by get_reward_value); minus their mean 0.75, broadcast on the mask
    expected = torch.tensor([[0.25, 0.25, 0.0], [-0.75, 0.0, 0.0], [-0.75, 0.0, -0.75], [1.25, 1.25, 0.0]])
    torch.testing.assert_close(batch.advantages, expected)
    with pytest.raises(ValueError, match="needs the rollout's samples"):
        rl_step.compute_advantages_and_returns(build_rollout_batch(samples), config)


def test_advantage_function_sets_advantages_and_returns_then_whitening_applies():
    samples = two_by_two()
    config = TrainConfig(n_samples_per_prompt=2, disable_rewards_normalization=True,
                         custom_advantage_function_path=f"{HOOKS}.position_weighted")
    batch = rl_step.compute_advantages_and_returns(build_rollout_batch(samples), config)
    # A_t = r·(t + 1) with raw rewards 1, 0, 0, 2; the tool token of sample 2 is masked
    expected = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [2.0, 4.0, 0.0]])
    torch.testing.assert_close(batch.advantages, expected)
    torch.testing.assert_close(batch.returns[:, :2], expected[:, :2])
    whitened = rl_step.compute_advantages_and_returns(
        build_rollout_batch(samples), TrainConfig(**{**config.__dict__, "normalize_advantages": True}))
    torch.testing.assert_close(whitened.advantages, normalize_advantages(expected, whitened.loss_masks))


def test_tis_function_weighs_and_rejects_tokens_with_slimes_signature():
    config = TrainConfig(n_samples_per_prompt=2, use_tis=True, custom_tis_function_path=f"{HOOKS}.mis_token_mask",
                         args={"tis_lower_bound": 0.5, "tis_upper_bound": 2.0})
    mb = build_rollout_batch(two_by_two())
    mb = mb.with_(advantages=mb.loss_masks.clone())  # A = 1 on every trained token
    # train/rollout ratios: [1, 3] | [0.25] | [1.5, 1, 1] | [1, 2]; 3 and 0.25 fall outside [0.5, 2]
    ratios = torch.tensor([[1.0, 3.0, 1.0], [0.25, 1.0, 1.0], [1.5, 1.0, 1.0], [1.0, 2.0, 1.0]])
    log_probs = (-0.5 + ratios.log()).requires_grad_()
    loss, metrics = rl_step.policy_loss(config, mb, log_probs=log_probs, entropy=torch.zeros_like(log_probs),
                                        reduce=lambda x: (x * mb.loss_masks).sum())
    # pg = -ratio_ppo·A = -1 per token, times the kept weight: -(1 + 0) - 0 - (1.5 + 1) - (1 + 2)
    assert metrics["pg_loss"].item() == pytest.approx(-6.5)
    assert metrics["mis_reject_fraction"].item() == pytest.approx(2.0)  # the two rejected trained tokens
    loss.backward()  # d(-exp(log π - log π_old)·A·w)/d log π = -A·w at ratio 1; rejected and masked tokens: 0
    torch.testing.assert_close(log_probs.grad, -torch.tensor([[1.0, 0, 0], [0, 0, 0], [1.5, 0, 1], [1, 2, 0]]))


def test_hooks_come_from_slime_args_and_custom_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    (tmp_path / "mis.yaml").write_text("use_tis: true\ntis_level: token\ntis_lower_bound: 0.5\ntis_upper_bound: 2.0\n")
    argv = (f"--hf-checkpoint {tmp_path} --prompt-data d.jsonl --rollout-batch-size 2 --num-rollout 1 "
            f"--custom-config-path {tmp_path}/mis.yaml --custom-tis-function-path {HOOKS}.mis_token_mask "
            f"--custom-advantage-function-path {HOOKS}.position_weighted "
            f"--custom-reward-post-process-path {HOOKS}.center_rewards")
    spec = parse_spec({"slime_args": argv})
    train = spec.train
    assert train.use_tis and train.custom_tis_function_path == f"{HOOKS}.mis_token_mask"  # use_tis from the YAML
    assert (train.args["tis_lower_bound"], train.args["tis_level"]) == (0.5, "token")
    assert spec.slime_sources["use_tis"] == f"{tmp_path}/mis.yaml's use_tis, from --custom-config-path (argv[8])"
    assert train.custom_advantage_function_path and train.custom_reward_post_process_path
    with pytest.raises(InvalidArgument, match="custom_advantage_function_path: 'os.system' is not under an allowed"):
        parse_spec({"slime_args": argv + " --custom-advantage-function-path os.system"})


@pytest.fixture
def rollout(tiny_model_dir) -> list[Sample]:
    samples = samples_of(tiny_model_dir, [("12+34=", "46", 1.0), ("12+34=", "55", 0.0), ("1+2=", "3", 0.0),
                                          ("1+2=", "4", 1.0)])
    for sample in samples:  # engines' log-probs far from the model's on the second token: MIS rejects it
        sample.rollout_log_probs = [-1.0] * sample.response_length
        sample.rollout_log_probs[1] = -30.0
    return samples


def test_the_three_hooks_train_a_step_of_the_tiny_model(tiny_model_dir, rollout):
    from services.trainer.backends.fsdp.backend import TorchBackend

    config = TrainConfig(n_samples_per_prompt=2, lr=1e-3, lr_decay_style="constant", use_tis=True,
                         custom_tis_function_path=f"{HOOKS}.mis_token_mask",
                         custom_advantage_function_path=f"{HOOKS}.position_weighted",
                         custom_reward_post_process_path=f"{HOOKS}.center_rewards",
                         args={"tis_lower_bound": 1e-6, "tis_upper_bound": 1e6})
    backend = TorchBackend(tiny_model_dir, config, num_threads=1)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    (metrics,) = backend.train_rollout(rollout)
    # every sample's second token has w = exp(log π - (-30)) > 1e6: one rejected token per sample, a mean of 1/R_i
    mean_reject = sum(1 / s.response_length for s in rollout) / len(rollout)
    assert metrics["train/mis_reject_fraction"] == pytest.approx(mean_reject, rel=1e-5)
    assert math.isfinite(metrics["train/loss"])
    assert any(not torch.equal(before[n], p) for n, p in backend.model.named_parameters())
    with pytest.raises(InvalidArgument, match=r"custom_tis_function_path: .* takes 0 positional parameters"):
        TorchBackend(tiny_model_dir, TrainConfig(custom_tis_function_path="tests.tiny_samples.two_by_two_batch"),
                     num_threads=1)


def test_the_tis_function_runs_when_slime_would_call_it():
    mb = build_rollout_batch(two_by_two())
    path = f"{HOOKS}.mis_token_mask"
    assert rl_step.custom_tis(TrainConfig(custom_tis_function_path=path), mb) is None  # neither use_tis nor metrics
    assert rl_step.custom_tis(TrainConfig(custom_tis_function_path=path, use_tis=True), mb) is not None
    assert rl_step.custom_tis(TrainConfig(custom_tis_function_path=path, args={"get_mismatch_metrics": True}),
                              mb) is not None  # slime's --get-mismatch-metrics: the function's metrics alone
    assert rl_step.custom_tis(TrainConfig(use_tis=True), mb) is None  # the truncated ratio, tis_clip
