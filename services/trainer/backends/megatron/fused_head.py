"""GPTModel's forward stopped before its vocab-parallel output layer: the model returns the final hidden states
(gathered over the TP group as the output layer would: all-gathered under sequence parallelism, their gradient
summed over the group), and the log-probs come from them and this rank's slice of the head by the fused, chunked
computation (`algorithms.fused_log_probs`), without the [tokens × vocab/tp] logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


class _AllReduceGrad(torch.autograd.Function):
    """Forward: a copy; backward: the gradient summed over `group` into a fresh tensor. megatron-core's
    copy_to_tensor_model_parallel_region all-reduces the incoming gradient in place: behind the fused head that
    gave wrong LM-head gradients at TP 2 on padded micro-batches."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass
class Head:
    """The output layer's weight (this TP rank's vocabulary rows) as the forward used it."""
    weight: torch.Tensor | None = None


def gpt_of(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


@contextlib.contextmanager
def hidden_states_out(model: torch.nn.Module, enabled: bool = True) -> Iterator[Head | None]:
    """Within it, `model`'s forward returns the hidden states [b, s, H] its output layer would project (on the last
    pipeline stage); the yielded Head holds the weight that layer was given. enabled False: the model as it is."""
    layer = getattr(gpt_of(model), "output_layer", None)
    if not enabled or layer is None:
        yield None
        return
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    head = Head()
    tp_size = layer.config.tensor_model_parallel_size
    group = getattr(layer, "tp_group", None)

    def forward(input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        head.weight = layer.weight if weight is None else weight
        if layer.sequence_parallel:  # [s/tp, b, H] -> [s, b, H]; backward: the gradient reduce-scattered
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group), None
        if tp_size > 1:  # backward: each rank's vocab slice's share of the gradient, summed over the group
            return _AllReduceGrad.apply(input_, group), None
        return input_, None

    layer.forward = forward
    try:
        yield head
    finally:
        del layer.forward
