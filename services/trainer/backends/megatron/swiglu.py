"""A dense MLP whose SwiGLU runs on linear_fc1's fused [gate | up] output without splitting it: its backward writes
both halves' gradients into one [.., 2f] tensor (megatron-core's unfused glu chunks the output, so autograd
concatenates the halves' gradients: a copy per layer) and its forward adds no `up + 0` offset. The same kernels as
torch's silu and mul, so the numbers are bit for bit those of megatron-core's own glu.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP


class _FusedSwiGLU(torch.autograd.Function):
    """silu(x[.., :f]) * x[.., f:] -> [.., f]; saves the input and silu(gate), as autograd would for the split form."""

    @staticmethod
    def forward(ctx, fused: torch.Tensor) -> torch.Tensor:
        gate, up = fused.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(fused, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        fused, activated = ctx.saved_tensors
        gate, up = fused.chunk(2, dim=-1)
        grad_fused = torch.empty_like(fused)
        grad_gate, grad_up = grad_fused.chunk(2, dim=-1)
        torch.mul(grad, activated, out=grad_up)  # d/d up = grad · silu(gate)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_fused


def fused_swiglu(fused: torch.Tensor) -> torch.Tensor:
    return _FusedSwiGLU.apply(fused)


class FusedSwiGLUMLP(MLP):
    """megatron-core's MLP; where it would run its unfused glu on SwiGLU (no Transformer Engine activation, no bias
    fusion, no clamp or offset, no per-token scale, not under torch.compile), `fused_swiglu` instead. Anything else
    is megatron-core's path."""

    is_dense_mlp = True  # position-wise, as megatron-core's MLP (`last_layer_rows`)

    def _fused_applies(self, per_token_scale) -> bool:
        config = self.config
        # a compiled layer keeps megatron-core's glu, which inductor fuses on its own
        return (per_token_scale is None and not torch.compiler.is_compiling() and config.gated_linear_unit
                and self.activation_func is F.silu and not config.use_te_activation_func
                and not config.bias_activation_fusion and config.activation_func_clamp_value is None
                and config.glu_linear_offset == 0.0)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self._fused_applies(per_token_scale):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(fused_swiglu(intermediate))
