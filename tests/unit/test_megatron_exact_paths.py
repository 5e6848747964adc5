"""The megatron backend's cheaper paths give megatron-core's own numbers bit for bit: SwiGLU on linear_fc1's fused
output (`swiglu.py`), rotary embeddings over the whole head (`rotary.py`) and the host clip by a norm already taken
(`model._clip`), each against megatron-core's code on the same inputs."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _megatron_glu(fused: torch.Tensor) -> torch.Tensor:
    """megatron-core's unfused glu in MLP.forward (no clamp; glu_linear_offset 0.0)."""
    gate, up = torch.chunk(fused, 2, dim=-1)
    return F.silu(gate) * (up + 0.0)


def _forward_and_grad(fn, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad


def test_fused_swiglu_equals_megatron_glu_bit_for_bit():
    from services.trainer.backends.megatron.swiglu import fused_swiglu

    gen = torch.Generator().manual_seed(0)
    for shape in ((7, 3, 2 * 24), (11, 2 * 40)):  # padded [s, b, 2f] and packed [t, 2f]
        x = torch.randn(shape, generator=gen) * 4  # silu's tails too
        grad = torch.randn((*shape[:-1], shape[-1] // 2), generator=gen)
        out, x_grad = _forward_and_grad(fused_swiglu, x, grad)
        want_out, want_grad = _forward_and_grad(_megatron_glu, x, grad)
        assert torch.equal(out, want_out)
        assert torch.equal(x_grad, want_grad)
        assert x_grad.shape == x.shape and x_grad.is_contiguous()


def test_fused_swiglu_mlp_keeps_megatron_path_where_it_differs():
    """A clamp, an offset or a per-token scale is megatron-core's own glu (the fused one has none of them)."""
    from types import SimpleNamespace

    from services.trainer.backends.megatron.swiglu import FusedSwiGLUMLP

    base = dict(gated_linear_unit=True, use_te_activation_func=False, bias_activation_fusion=False,
                activation_func_clamp_value=None, glu_linear_offset=0.0)
    mlp = FusedSwiGLUMLP.__new__(FusedSwiGLUMLP)  # the check reads config and activation_func alone
    mlp.__dict__.update(config=SimpleNamespace(**base), activation_func=F.silu)
    assert mlp._fused_applies(None)
    assert not mlp._fused_applies(torch.ones(3))
    for field, value in (("activation_func_clamp_value", 7.0), ("glu_linear_offset", 1.0),
                         ("bias_activation_fusion", True), ("gated_linear_unit", False)):
        mlp.__dict__["config"] = SimpleNamespace(**{**base, field: value})
        assert not mlp._fused_applies(None), field
    mlp.__dict__["config"] = SimpleNamespace(**base)
    mlp.__dict__["activation_func"] = F.gelu
    assert not mlp._fused_applies(None)


def test_rotary_over_the_whole_head_equals_megatron_bit_for_bit():
    from megatron.core.models.common.embeddings import rope_utils

    from services.trainer.backends.megatron import rotary

    rotary.apply()
    rotary.apply()  # idempotent: one wrapper
    ours = rope_utils._apply_rotary_pos_emb_bshd
    theirs = ours.__wrapped__
    assert not hasattr(theirs, "__wrapped__")
    gen = torch.Generator().manual_seed(0)
    # a query as the fused QKV projection's split leaves it: a non-contiguous view
    qkv = torch.randn(9, 2, 3, 4 * 16, generator=gen)
    query = qkv[..., :32].unflatten(-1, (2, 16)).flatten(2, 3)
    freqs = torch.randn(9, 1, 1, 16, generator=gen)
    grad_out = torch.randn(9, 2, 6, 16, generator=gen)
    for kwargs in ({}, {"rotary_interleaved": True}, {"mscale": 0.75}):
        want_out, want_grad = _forward_and_grad(functools.partial(theirs, freqs=freqs, **kwargs), query, grad_out)
        out, grad = _forward_and_grad(functools.partial(ours, freqs=freqs, **kwargs), query, grad_out)
        assert torch.equal(out, want_out) and torch.equal(grad, want_grad), kwargs
    # a partial rotary (a pass-through tail) is megatron-core's own path
    partial = freqs[..., :8]
    assert torch.equal(ours(query, partial), theirs(query, partial))


def test_host_clip_equals_megatron_clip_bit_for_bit():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from services.trainer.backends.megatron.model import _clip
    from services.trainer.distributed import megatron_cpu

    def params() -> list[torch.nn.Parameter]:
        out = []
        for shape in ((5, 3), (7,), (2, 2)):
            p = torch.nn.Parameter(torch.zeros(shape))
            p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(len(out)))
            out.append(p)
        out.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: left out
        return out

    for total_norm in (3.7, 0.5):  # clipped, and under the max norm (left as it is)
        ours, theirs = params(), params()
        _clip(ours, 1.0, total_norm, decoupled=False)
        with megatron_cpu.cuda_to_cpu():  # megatron-core asserts CUDA gradients
            clip_grad_by_total_norm_fp32(theirs, max_norm=1.0, total_norm=total_norm)
        for a, b in zip(ours[:3], theirs[:3], strict=True):
            assert torch.equal(a.grad, b.grad)
        assert ours[3].grad is None
    unclipped = params()
    _clip(unclipped, 1.0, 0.5, decoupled=False)
    assert torch.equal(unclipped[0].grad, params()[0].grad)
