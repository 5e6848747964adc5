"""MiniMax-M2's q and k RMSNorms over the whole projection (all heads at once) in megatron-core's attention, where
each TP rank holds its heads: the mean square is summed over the TP ranks (forward and backward), the weight is cut
over TP as the heads are (marked tensor-parallel, so the HF export gathers it)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) over the TP group, forward and backward: every rank's output depends on every rank's part."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ProjectionRMSNorm(torch.nn.Module):
    heads_field = "num_attention_heads"

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused) -> None:
        from megatron.core import parallel_state

        super().__init__()
        tp = config.tensor_model_parallel_size
        self.head_dim, self.heads, self.eps = hidden_size, getattr(config, self.heads_field) // tp, eps
        self.total = getattr(config, self.heads_field) * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(self.heads * hidden_size, dtype=config.params_dtype))
        self.weight.tensor_model_parallel, self.weight.partition_dim, self.weight.partition_stride = True, 0, 1
        self.group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight in dist-checkpoints as the TP shard it is (dim 0), not one replicated tensor."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=self.group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., heads on this rank, head_dim] -> the same, normalized over every rank's heads."""
        squares = x.float().pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.group is not None:
            squares = _SumOverTP.apply(squares, self.group)
        normed = x.float() * torch.rsqrt(squares / self.total + self.eps)
        return self.weight.view(self.heads, self.head_dim) * normed.to(x.dtype)


class QProjectionRMSNorm(_ProjectionRMSNorm):
    heads_field = "num_attention_heads"


class KProjectionRMSNorm(_ProjectionRMSNorm):
    heads_field = "num_query_groups"
