"""A marked weight's linear layer adds its gradient to main_grad in its own backward (`host_linear.py`): the output,
the input's and the bias's gradients and main_grad over several micro-batches are megatron-core's bit for bit (its
linear function, the gradient then added by DDP's hook), in float32 and bf16; an unmarked weight is megatron-core's
own path; DDP overlapping its gradient reduce marks nothing."""

from __future__ import annotations

import torch

CALL = dict(gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
            grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None)


def _weights(dtype: torch.dtype) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(40, 24, generator=gen).to(dtype))
    bias = torch.nn.Parameter(torch.randn(40, generator=gen).to(dtype))
    weight.main_grad = torch.zeros(40, 24)  # DDP's float32 buffer
    return weight, bias


def _micro_batches(linear, weight, bias, dtype: torch.dtype, *, hook: bool):
    """Three micro-batches [s, b, in] through `linear`; with hook, DDP's: the returned gradient added to main_grad."""
    gen = torch.Generator().manual_seed(1)
    outs, input_grads = [], []
    for _ in range(3):
        x = torch.randn(7, 3, 24, generator=gen).to(dtype).requires_grad_()
        out = linear(x, weight, bias, **CALL)
        out.backward(torch.randn(out.shape, generator=gen).to(dtype))
        if hook:
            weight.main_grad.add_(weight.grad)
            weight.grad = None
        outs.append(out.detach())
        input_grads.append(x.grad)
    assert weight.grad is None
    return outs, input_grads, weight.main_grad, bias.grad


def test_marked_linear_is_megatron_core_bit_for_bit():
    from megatron.core.tensor_parallel import layers

    from services.trainer.backends.megatron import host_linear

    host_linear.apply()
    host_linear.apply()  # idempotent: one wrapper
    ours = layers.linear_with_grad_accumulation_and_async_allreduce
    theirs = ours.__wrapped__
    assert not hasattr(theirs, "__wrapped__")
    for dtype in (torch.float32, torch.bfloat16):
        weight, bias = _weights(dtype)
        host_linear.mark(torch.nn.ParameterList([weight]), overlap_grad_reduce=False)
        got = _micro_batches(ours, weight, bias, dtype, hook=False)
        weight, bias = _weights(dtype)
        want = _micro_batches(theirs, weight, bias, dtype, hook=True)
        for a, b in zip(got[0] + got[1] + [got[2], got[3]], want[0] + want[1] + [want[2], want[3]], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), dtype
        assert got[2].abs().sum() > 0


def test_unmarked_weights_take_megatron_core_path():
    from megatron.core.tensor_parallel import layers

    from services.trainer.backends.megatron import host_linear

    host_linear.apply()
    weight, bias = _weights(torch.float32)
    host_linear.mark(torch.nn.ParameterList([weight]), overlap_grad_reduce=True)  # its hooks must see the gradients
    assert not getattr(weight, host_linear.DIRECT, False)
    x = torch.randn(5, 2, 24, requires_grad=True)
    layers.linear_with_grad_accumulation_and_async_allreduce(x, weight, bias, **CALL).sum().backward()
    assert weight.grad is not None and not weight.main_grad.any()  # returned to autograd, main_grad untouched
    no_buffer = torch.nn.Parameter(torch.zeros(3))
    host_linear.mark(torch.nn.ParameterList([no_buffer]), overlap_grad_reduce=False)
    assert not getattr(no_buffer, host_linear.DIRECT, False)
