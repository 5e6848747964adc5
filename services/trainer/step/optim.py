"""The optimizer and its learning-rate schedule: AdamW with Megatron's parameter groups and Megatron's lr schedule.

Megatron decays no biases and no 1-D parameters (norms). The schedule is Megatron's `OptimizerParamScheduler` in
optimizer steps: linear warmup from 0 over lr_warmup_iters, then constant, or a linear / cosine decay to min_lr by
lr_decay_iters. The count of steps taken lives in each param group (`num_steps`), so it is saved and restored with
the optimizer's state_dict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from services.trainer.settings.train import LR_DECAY_STYLES

FUSED_DEVICES = ("cpu", "cuda")  # where torch's fused AdamW kernel runs


def make_adamw(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float, weight_decay: float,
               adam_beta1: float, adam_beta2: float, adam_eps: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only (Megatron's no-decay rule). torch's fused
    kernel where every parameter is a floating-point one on a device it runs on (the same update, one pass over each
    parameter: a quarter of the per-tensor loop's time on the CPU bench's model)."""
    decay, no_decay = [], []
    for name, param in named_parameters:
        if param.requires_grad:
            (no_decay if name.endswith(".bias") or param.ndim == 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in decay + no_decay)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(adam_beta1, adam_beta2), eps=adam_eps,
                             fused=fused or None)


def lr_at(num_steps: int, *, lr: float, min_lr: float = 0.0, lr_warmup_iters: int = 0,
          lr_decay_style: str = "constant", lr_decay_iters: int | None = None) -> float:
    """Megatron's learning rate after `num_steps` optimizer steps (the rate the next step uses).

    Warmup: lr·n/lr_warmup_iters while n <= lr_warmup_iters. Then constant: lr; past lr_decay_iters: min_lr;
    otherwise min_lr + c·(lr - min_lr) with r = (n - warmup)/(decay_iters - warmup), c = 1 - r (linear) or
    (cos(π·r) + 1)/2 (cosine). lr_decay_iters None: no decay.
    """
    if lr_warmup_iters > 0 and num_steps <= lr_warmup_iters:
        return lr * num_steps / lr_warmup_iters
    if lr_decay_style == "constant" or lr_decay_iters is None:
        return lr
    if num_steps > lr_decay_iters:
        return min_lr
    ratio = (num_steps - lr_warmup_iters) / (lr_decay_iters - lr_warmup_iters)
    if lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown lr_decay_style {lr_decay_style!r}; valid: {', '.join(LR_DECAY_STYLES)}")
    return min_lr + coeff * (lr - min_lr)


def scheduled_step(optimizer: torch.optim.Optimizer, **schedule) -> float:
    """One optimizer step at the scheduled rate (`lr_at` keywords); returns the rate used."""
    num_steps = optimizer.param_groups[0].get("num_steps", 0)
    lr = lr_at(num_steps, **schedule)
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["num_steps"] = num_steps + 1
    optimizer.step()
    return lr


def lr_schedule(config) -> dict:
    """The `lr_at` keywords of a TrainConfig."""
    return {"lr": config.lr, "min_lr": config.min_lr, "lr_warmup_iters": config.lr_warmup_iters,
            "lr_decay_style": config.lr_decay_style, "lr_decay_iters": config.lr_decay_iters}
