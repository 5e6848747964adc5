"""Device placement on a CPU-only machine: the loss, log-prob, advantage and batch code with every input on `meta`
under a same-device check; backends run under the rule that project code names the device of what it creates;
models placed on the rank's device; dtype defaults."""

from __future__ import annotations

import pytest
import torch

from services.common.samples import Sample
from services.trainer.algorithms.kl import KL_LOSS_TYPES, compute_approx_kl
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.batching.batch import build_rollout_batch
from services.trainer.distributed import devices
from services.trainer.distributed.parallel import World
from services.trainer.settings.train import TrainConfig
from services.trainer.step import rl_step
from tests.device_check import DeviceMismatch, SameDevice
from tests.tiny_samples import samples_of, two_by_two_batch
from tests.unit.test_fsdp_rl import ESTIMATOR_CONFIGS, ROLLOUT

META = torch.device("meta")
VOCAB = 16


def meta_batch(**computed):
    batch = two_by_two_batch()
    like = torch.zeros_like(batch.loss_masks)
    extra = {name: like for name in computed}
    return batch.with_(**extra).to(META)


def test_the_check_catches_what_meta_alone_lets_through():
    values, index = torch.zeros(2, 3, device=META), torch.zeros(2, 1, dtype=torch.long)
    values.gather(-1, index)  # torch accepts a CPU index on a meta tensor
    with SameDevice(), pytest.raises(DeviceMismatch, match="gather mixes devices"):
        values.gather(-1, index)
    with SameDevice():
        values * torch.tensor(2.0)  # a 0-dim CPU tensor is allowed, as next to CUDA tensors


def test_the_factory_rule_flags_project_code_only():
    from services.trainer.batching.batch import RolloutBatch

    batch = two_by_two_batch()
    with SameDevice(named_factories=True):
        torch.arange(3)  # test code may leave the device out
        batch.take([0, 2])
    original = RolloutBatch.logit_positions

    def unplaced(self):  # the bug a GPU run once showed: offsets made on the CPU
        return self.prompt_lengths.unsqueeze(-1) - 1 + torch.arange(self.response_tokens.shape[1])

    unplaced.__code__ = unplaced.__code__.replace(co_filename=RolloutBatch.take.__code__.co_filename)
    RolloutBatch.logit_positions = unplaced
    try:
        with SameDevice(named_factories=True), pytest.raises(DeviceMismatch, match="without device="):
            batch.logit_positions()
        with SameDevice(), pytest.raises(DeviceMismatch, match="mixes devices"):
            meta_batch().logit_positions()
    finally:
        RolloutBatch.logit_positions = original


@pytest.mark.parametrize("name", sorted(ESTIMATOR_CONFIGS))
def test_advantages_on_meta(name):
    config = TrainConfig(n_samples_per_prompt=2, **ESTIMATOR_CONFIGS[name])
    batch = meta_batch(log_probs=True, ref_log_probs=True, values=True)
    with SameDevice() as check:
        out = rl_step.compute_advantages_and_returns(batch, config)
        returns = rl_step.critic_returns(batch, config)
    assert out.advantages.device == META and out.returns.device == META and returns.device == META
    assert check.num_checked > 5


@pytest.mark.parametrize("overrides", [
    {}, {"advantage_estimator": "gspo"}, {"advantage_estimator": "cispo", "eps_clip": 1.0, "eps_clip_high": 4.0},
    {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl", "use_unbiased_kl": True},
    {"use_tis": True, "eps_clip_c": 3.0, "entropy_coef": 0.01, "calculate_per_token_loss": True},
    {"use_rollout_logprobs": True}, {"loss_type": "sft_loss"}])
def test_micro_batch_loss_on_meta(overrides):
    config = TrainConfig(n_samples_per_prompt=2, rollout_temperature=0.7, **overrides)
    mb = meta_batch(log_probs=True, ref_log_probs=True)
    logits = torch.zeros(mb.size, mb.tokens.shape[1], VOCAB, device=META, requires_grad=True)
    mask_sums = mb.loss_masks.sum(dim=-1)
    with SameDevice():
        reduce = rl_step.make_reducer(config, mb.loss_masks, mask_sums, 4.0)
        loss, metrics = rl_step.micro_batch_loss(config, mb, logits=logits, reduce=reduce)
        loss.backward()
    assert loss.device == META and logits.grad.device == META
    assert all(value.device == META for value in metrics.values())


def test_value_loss_and_kl_on_meta():
    mb = meta_batch(values=True, ref_log_probs=True)
    mb = mb.with_(returns=torch.zeros(mb.loss_masks.shape, device=META))
    config = TrainConfig(advantage_estimator="ppo")
    with SameDevice():
        reduce = rl_step.make_reducer(config, mb.loss_masks, mb.loss_masks.sum(dim=-1), 4.0)
        loss, _ = rl_step.value_loss(config, mb, values=torch.zeros_like(mb.loss_masks), reduce=reduce)
        for kind in KL_LOSS_TYPES:
            compute_approx_kl(mb.ref_log_probs, mb.ref_log_probs, kl_loss_type=kind)
    assert loss.device == META


def test_response_gather_on_meta():
    mb = meta_batch()
    with SameDevice():
        log_probs, entropy = rl_step.response_log_probs(torch.zeros(mb.size, mb.tokens.shape[1], VOCAB, device=META),
                                                        mb, TrainConfig())
    assert log_probs.shape == mb.loss_masks.shape and log_probs.device == META and log_probs.dtype == torch.float32


def test_batch_is_built_on_the_host_and_moved_once():
    batch = build_rollout_batch([Sample(tokens=[1, 2, 3], response_length=1)], device=META)
    assert {getattr(batch, name).device for name in ("tokens", "loss_masks", "rewards", "prompt_lengths")} == {META}
    assert batch.logit_positions().device == META


@pytest.fixture
def samples(tiny_model_dir):
    return samples_of(tiny_model_dir, ROLLOUT)


@pytest.mark.parametrize("overrides", [{"use_kl_loss": True, "kl_loss_coef": 0.1, "global_batch_size": 2},
                                       {"advantage_estimator": "ppo", "micro_batch_size": 2}])
def test_fsdp_backend_names_every_device(tiny_model_dir, samples, overrides):
    backend = TorchBackend(tiny_model_dir, TrainConfig(n_samples_per_prompt=2, lr=1e-3, **overrides), num_threads=1)
    with SameDevice(named_factories=True) as check:
        metrics = backend.train_rollout(samples)
        backend.compute_log_probs(samples)
    assert metrics and check.num_checked > 100


def test_fsdp_backend_puts_every_model_on_the_ranks_device(tiny_model_dir):
    config = TrainConfig(n_samples_per_prompt=2, advantage_estimator="ppo", kl_coef=0.05)
    backend = TorchBackend(tiny_model_dir, config, num_threads=1, world=World(device=META))
    models = [backend.model, backend.ref_model, backend.critic.model]
    assert {t.device for m in models for t in [*m.parameters(), *m.buffers()]} == {META}


def test_dtype_defaults_bf16_on_cuda_fp32_on_cpu():
    assert devices.train_dtype(None, torch.device("cpu")) == torch.float32
    assert devices.train_dtype(None, torch.device("cuda", 0)) == torch.bfloat16
    assert devices.train_dtype(True, torch.device("cpu")) == torch.bfloat16
    assert devices.train_dtype(False, torch.device("cuda", 0)) == torch.float32
    with pytest.raises(ValueError, match="fp16: not supported.*use bf16"):
        TrainConfig(fp16=True)


def test_rank_device():
    assert devices.rank_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert devices.rank_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            devices.rank_device("cuda")
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        devices.rank_device("tpu")


def test_torch_free_copies_of_the_choices_match():
    import typing

    from services.trainer.api import config
    from services.trainer.api.spec import JobSpec
    from services.trainer.api.spec_defaults import spec_defaults

    assert config.DEVICES == devices.DEVICES
    assert set(config.WEIGHT_SYNC_BACKENDS) == set(typing.get_args(JobSpec.model_fields["weight_sync_backend"]
                                                                   .annotation))
    trainer = config.TrainerConfig(default_weight_sync_backend="nccl")
    assert spec_defaults(trainer)["weight_sync_backend"] == "nccl"
