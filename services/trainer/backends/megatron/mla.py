"""The local layer spec's pieces for megatron-core's multi-latent attention (models/deepseek_v3.py's families): the q
and kv latent norms at transformers' eps, and the kv down-projection whole on every tensor-parallel rank, its shared
rope key's gradient summed over the TP ranks' heads.
"""

from __future__ import annotations

import torch

from services.trainer.backends.megatron.norm import SequenceParallelRMSNorm
from services.trainer.models.deepseek_v3 import LATENT_NORM_EPS


class LatentRMSNorm(SequenceParallelRMSNorm):
    """MLA's q_a and kv_a norms, which transformers builds with its RMSNorm's default eps whatever rms_norm_eps says
    (GLM-4.7-Flash: rms_norm_eps 1e-5); megatron-core would give them the config's."""

    def __init__(self, config, hidden_size: int, eps: float = LATENT_NORM_EPS, **_unused) -> None:
        super().__init__(config, hidden_size, eps=LATENT_NORM_EPS)


class _SumRopeGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the last `rope_dim` columns' gradient over the TP group. The shared rope key
    feeds every head, and each TP rank holds only its heads: without the sum its gradient would be this rank's part."""

    @staticmethod
    def forward(ctx, latent: torch.Tensor, rope_dim: int, group) -> torch.Tensor:
        ctx.rope_dim, ctx.group = rope_dim, group
        return latent.view_as(latent)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.clone()
        rope = grad[..., -ctx.rope_dim:].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        grad[..., -ctx.rope_dim:] = rope
        return grad, None, None


class LatentKVDownProjection(torch.nn.Module):
    """MLA's kv down-projection whole on every TP rank (the local spec's column-parallel one leaves the rope key's
    gradient partial at TP > 1 without sequence parallelism: megatron-core's gather before it only splits the
    gradient again). Under sequence parallelism megatron-core gathers the rope key itself (its backward sums over TP)
    and each rank sees its slice of the tokens, so the weight's gradient is summed over TP as the norms' are."""

    def __init__(self, config, in_features: int, out_features: int, rope_dim: int, tp_group) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=config.params_dtype))
        config.init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel
        self.rope_dim, self.tp_group, self.sequence_parallel = rope_dim, tp_group, config.sequence_parallel

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        latent = torch.nn.functional.linear(hidden, self.weight)
        if not self.sequence_parallel and dist.get_world_size(self.tp_group) > 1:
            latent = _SumRopeGradOverTP.apply(latent, self.rope_dim, self.tp_group)
        return latent, None


def whole_kv_down_projections(gpt: torch.nn.Module, config) -> None:
    """Replace every MLA layer's kv down-projection by a LatentKVDownProjection (local spec)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for module in gpt.modules():
        if isinstance(module, MLASelfAttention):
            module.linear_kv_down_proj = LatentKVDownProjection(
                config, config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim,
                config.qk_pos_emb_head_dim, parallel_state.get_tensor_model_parallel_group())
