"""Megatron's lr schedule at chosen steps, the no-decay parameter groups, and the step count kept in the optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.settings.train import LR_DECAY_STYLES
from services.trainer.step.optim import LR_DECAY_STYLES as OPTIM_STYLES
from services.trainer.step.optim import lr_at, make_adamw, scheduled_step

SCHEDULE = {"lr": 1.0, "min_lr": 0.1, "lr_warmup_iters": 2, "lr_decay_iters": 6}


@pytest.mark.parametrize("step, expected", [(0, 0.0), (1, 0.5), (2, 1.0), (3, 0.1 + 0.75 * 0.9), (5, 0.1 + 0.25 * 0.9),
                                            (6, 0.1), (9, 0.1)])
def test_linear_warmup_then_linear_decay_to_min_lr(step, expected):
    assert lr_at(step, lr_decay_style="linear", **SCHEDULE) == pytest.approx(expected)


@pytest.mark.parametrize("step, expected", [(1, 0.5), (3, 0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1)),
                                            (4, 0.55), (6, 0.1), (7, 0.1)])
def test_cosine_decay(step, expected):
    assert lr_at(step, lr_decay_style="cosine", **SCHEDULE) == pytest.approx(expected)


@pytest.mark.parametrize("step, expected", [(0, 0.0), (1, 0.5), (2, 1.0), (50, 1.0)])
def test_constant_after_warmup(step, expected):
    assert lr_at(step, lr_decay_style="constant", **SCHEDULE) == pytest.approx(expected)


def test_no_warmup_starts_at_lr_and_no_decay_iters_means_constant():
    assert lr_at(0, lr=2e-6, lr_decay_style="linear", lr_decay_iters=4) == 2e-6
    assert lr_at(2, lr=2e-6, lr_decay_style="linear", lr_decay_iters=4) == pytest.approx(1e-6)
    assert lr_at(100, lr=2e-6, lr_decay_style="cosine", lr_decay_iters=None) == 2e-6
    with pytest.raises(ValueError, match="unknown lr_decay_style 'step'"):
        lr_at(1, lr=1.0, lr_decay_style="step", lr_decay_iters=3)
    assert OPTIM_STYLES == LR_DECAY_STYLES


def test_weight_decay_skips_biases_and_vectors():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
    optimizer = make_adamw(model.named_parameters(), lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999,
                           adam_eps=1e-8)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [(3, 2)]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3  # linear bias, norm weight and bias
    assert optimizer.defaults["betas"] == (0.9, 0.999) and optimizer.defaults["eps"] == 1e-8


def test_scheduled_steps_use_the_schedule_and_the_count_survives_the_state_dict():
    param = torch.nn.Parameter(torch.zeros(2, 2))
    optimizer = make_adamw([("w", param)], lr=1.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
    schedule = {"lr": 1.0, "lr_warmup_iters": 2, "lr_decay_style": "constant"}
    used = []
    for _ in range(2):
        param.grad = torch.ones(2, 2)
        used.append(scheduled_step(optimizer, **schedule))
    assert used == [0.0, 0.5]
    restored = make_adamw([("w", param)], lr=1.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
    restored.load_state_dict(optimizer.state_dict())
    param.grad = torch.ones(2, 2)
    assert scheduled_step(restored, **schedule) == 1.0  # the third step, not a restarted warmup


def test_the_fused_kernel_runs_on_the_host_and_updates_as_the_per_tensor_loop():
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(4)]
    weights = []
    for build in ("make_adamw", "loop"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        named = list(zip(("w", "b"), params, strict=True))
        if build == "make_adamw":
            optimizer = make_adamw(named, lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-8)
            assert optimizer.defaults["fused"]
        else:  # torch's per-tensor loop over the same groups
            optimizer = torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.1},
                                           {"params": params[1:], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.98),
                                          eps=1e-8, foreach=False)
        for step in grads:
            for param, grad in zip(params, step, strict=True):
                param.grad = grad.clone()
            optimizer.step()
        weights.append([p.detach() for p in params])
    for fused, loop in zip(*weights, strict=True):
        torch.testing.assert_close(fused, loop, atol=1e-7, rtol=1e-6)
