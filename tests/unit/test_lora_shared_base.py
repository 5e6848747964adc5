"""Two LoRA jobs on one base model in the trainer (lora_share_pool): the base is loaded once, each job's calls run with
its own adapter in the layers, one job's training leaves the other's adapter and log-probs as they were, and each
job's log-probs equal the merged model of its own adapter."""

from __future__ import annotations

import pytest
import torch

from services.common.samples import Sample
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.lora import layers as lora_layers
from services.trainer.lora.shared_base import SharedBases
from services.trainer.settings.train import TrainConfig
from tests.tiny_samples import samples_of

ROLLOUT = [("1+2=", "3", 1.0), ("1+2=", "4", 0.0), ("12+34=", "46", 0.0), ("12+34=", "55", 1.0)]
KEY = ("tiny", "fsdp", ("down_proj", "q_proj", "v_proj"), False)


@pytest.fixture
def samples(tiny_model_dir) -> list[Sample]:
    return samples_of(tiny_model_dir, ROLLOUT)


def config(**overrides) -> TrainConfig:
    return TrainConfig(**{"n_samples_per_prompt": 2, "lr": 1e-2, "micro_batch_size": 4, "bf16": False,
                          "lora_rank": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"],
                          "lora_share_pool": True, **overrides})


def attach(bases: SharedBases, model_dir, job_id: str, **overrides):
    return bases.attach(KEY, job_id, lambda base: TorchBackend(model_dir, config(**overrides), num_threads=1,
                                                               base_model=base))


def adapter_tensors(backend) -> dict[str, torch.Tensor]:
    _, weights = backend.adapter_weights()
    return {name: t.clone() for name, t in weights}


def assert_close(got: list[list[float]], want: list[list[float]], abs_tol: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=abs_tol)


def test_two_jobs_share_one_base_and_each_trains_and_reads_its_own_adapter(tiny_model_dir, samples):
    bases = SharedBases()
    a, base = attach(bases, tiny_model_dir, "a")
    b, same = attach(bases, tiny_model_dir, "b", lora_alpha=4.0)
    assert same is base and a.model is b.model  # the base held once
    base_ids = {id(p) for name, p in base.model.named_parameters() if "lora_" not in name}
    start = a.compute_log_probs(samples)
    a.train_rollout(samples)  # job a's step: its adapter moves, job b's stays as it was
    b_adapter = adapter_tensors(b)
    assert all(not t.any() for name, t in b_adapter.items() if "lora_B" in name)  # b's B still zero
    assert_close(b.compute_log_probs(samples), start, 1e-6)  # a fresh adapter: the base model's log-probs
    a_after = a.compute_log_probs(samples)
    assert max(abs(x - y) for g, w in zip(a_after, start, strict=True) for x, y in zip(g, w, strict=True)) > 1e-4
    b.train_rollout(samples)
    assert_close(a.compute_log_probs(samples), a_after, 1e-6)  # b's step left a's adapter alone
    assert {id(p) for name, p in base.model.named_parameters() if "lora_" not in name} == base_ids
    # each job's log-probs are the merged model of its own adapter (scaled by its own alpha)
    plain = TorchBackend(tiny_model_dir, TrainConfig(n_samples_per_prompt=2, micro_batch_size=4, bf16=False),
                         num_threads=1)
    for job in (a, b):
        plain.model.load_state_dict(dict(job.named_weights()), strict=False)
        assert_close(job.compute_log_probs(samples), plain.compute_log_probs(samples), 1e-5)
    a_adapter = adapter_tensors(a)
    assert a_adapter.keys() == b_adapter.keys()
    assert any((a_adapter[k] - adapter_tensors(b)[k]).abs().max() > 1e-4 for k in a_adapter)
    optimized = [{id(p) for group in job.optimizer.param_groups for p in group["params"]} for job in (a, b)]
    assert not optimized[0] & optimized[1] and not optimized[0] & base_ids  # an optimizer each, on its adapter
    bases.detach(KEY, "a")
    assert len(bases) == 1
    bases.detach(KEY, "b")
    assert len(bases) == 0  # the base goes with its last job


def test_a_job_that_attaches_gets_a_fresh_adapter_on_every_targeted_layer(tiny_model_dir):
    bases = SharedBases()
    a, base = attach(bases, tiny_model_dir, "a")
    with torch.no_grad():
        for _, layer in lora_layers.lora_layers(base.model):
            layer.lora_B.weight.fill_(0.5)
    b, _ = attach(bases, tiny_model_dir, "b", lora_rank=2)
    with base.turn:
        base.use("b")
        assert all(layer.rank == 2 and not layer.lora_B.weight.any() for _, layer in lora_layers.lora_layers(
            base.model))
        base.use("a")
        assert all(layer.rank == 4 and (layer.lora_B.weight == 0.5).all() for _, layer in lora_layers.lora_layers(
            base.model))
