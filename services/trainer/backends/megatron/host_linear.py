"""Off CUDA, a linear layer adds its weight gradient to main_grad itself. megatron-core's linear layers (without
Transformer Engine or apex) return each weight gradient to autograd, whose accumulator hands it to DDP's backward hook
to add to main_grad and drop: a Python hook per weight and micro-batch, behind a Python forward and
backward with autocast bookkeeping. Here the backward adds gradᵀ·input to main_grad itself (the same product and sum,
so the same numbers), for the layers of a DDP model that does not overlap its gradient reduce (whose hooks must see
each gradient) and that exchange nothing over the tensor-parallel group in the layer itself (no sequence
parallelism, no all-reduce of the input's gradient); every other call is megatron-core's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

DIRECT = "main_grad_direct"  # a parameter attribute: its linear layers add its gradient into main_grad themselves


@functools.cache
def apply() -> None:
    """Wrap megatron-core's linear function as its ColumnParallelLinear and RowParallelLinear call it; idempotent."""
    from megatron.core.tensor_parallel import layers

    layers.linear_with_grad_accumulation_and_async_allreduce = _direct_where_marked(
        layers.linear_with_grad_accumulation_and_async_allreduce)


def mark(model: torch.nn.Module, *, overlap_grad_reduce: bool) -> None:
    """Mark `model`'s parameters that DDP gave a main_grad, on the host, when DDP does not overlap its gradient
    reduce with the backward (each hook then only adds the gradient and drops it)."""
    if overlap_grad_reduce:
        return
    for param in model.parameters():
        if hasattr(param, "main_grad") and param.device.type == "cpu":
            setattr(param, DIRECT, True)


def _direct_where_marked(linear: Callable) -> Callable:
    @functools.wraps(linear)
    def call(input_, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
             grad_output_buffer=None, *args, **kwargs):
        if getattr(weight, DIRECT, False) and not (gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel
                                                    or grad_output_buffer is not None
                                                    or torch.is_autocast_enabled(input_.device.type)):
            return _IntoMainGrad.apply(input_, weight, bias)
        return linear(input_, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                      grad_output_buffer, *args, **kwargs)

    return call


class _IntoMainGrad(torch.autograd.Function):
    """input [.., in] · weightᵀ (+ bias) -> [.., out], as megatron-core's; the backward returns the input's and the
    bias's gradients and adds the weight's into weight.main_grad (none returned: no hook runs for it)."""

    @staticmethod
    def forward(ctx, input_, weight, bias):
        ctx.save_for_backward(input_, weight)
        ctx.use_bias = bias is not None
        output = torch.matmul(input_, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        input_2d = input_.reshape(-1, input_.shape[-1])
        # the product, then added: megatron-core's numbers bit for bit (an addmm_ into main_grad rounds the sum of
        # a step's micro-batches otherwise), in bf16 too (a bf16 product into float32 main_grad)
        weight.main_grad.add_(grad_2d.t().matmul(input_2d))
        grad_bias = grad_2d.sum(dim=0) if ctx.use_bias else None
        return grad_input, None, grad_bias
