"""The local layer spec's pieces for megatron-core's DeepSeek sparse attention (GLM-5, models/glm_moe_dsa.py):
DSAttention with its lightning indexer in every MLA layer, the indexer's linears whole on every TP rank, its key norm
at transformers' eps, and its Hadamard rotation in PyTorch wherever the fused CUDA kernel cannot run.
"""

from __future__ import annotations

import functools

import torch

from services.trainer.models.glm_moe_dsa import INDEXER_KEY_NORM_EPS


class IndexerLinear(torch.nn.Module):
    """One of the indexer's projections, the same on every rank (megatron-core's "duplicated" linear): (output,
    None) as megatron-core's linears return."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False,
                 **_unused) -> None:
        super().__init__()
        if bias:
            raise ValueError("the DSA indexer's projections have no bias")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


class IndexerKeyNorm(torch.nn.LayerNorm):
    """The indexer's key LayerNorm (weight and bias), at transformers' eps (megatron-core would give it the model's
    layernorm_epsilon)."""

    def __init__(self, config, hidden_size: int, eps: float = INDEXER_KEY_NORM_EPS, **_unused) -> None:
        super().__init__(hidden_size, eps=INDEXER_KEY_NORM_EPS, dtype=config.params_dtype)


@functools.lru_cache(maxsize=8)
def _hadamard(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order `dim` (a power of two), symmetric."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return (matrix * dim ** -0.5).to(dtype=dtype, device=device)


def hadamard_rotation(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's rotate_activation: fast_hadamard_transform's CUDA kernel (bf16 only) when it can run, else the
    same orthonormal transform as a matmul (exact in any dtype, on any device). Queries and keys turn alike, so the
    indexer's scores stay their dot products."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    if x.is_cuda and x.dtype == torch.bfloat16 and dsa.hadamard_transform is not None:
        return dsa.hadamard_transform(x, scale=x.size(-1) ** -0.5)
    return x @ _hadamard(x.size(-1), x.dtype, x.device)


def use_sparse_attention(block) -> None:
    """Give every layer of the MLA `block` spec megatron-core's DSAttention with the local indexer modules."""
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.spec_utils import ModuleSpec

    dsa.rotate_activation = hadamard_rotation  # its forward looks the rotation up in its module
    indexer = ModuleSpec(module=dsa.DSAIndexer, submodules=dsa.DSAIndexerSubmodules(
        linear_wq_b=IndexerLinear, linear_wk=IndexerLinear, k_norm=IndexerKeyNorm,
        linear_weights_proj=IndexerLinear))
    for layer_spec in {id(spec): spec for spec in block.layer_specs}.values():
        layer_spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=dsa.DSAttention, submodules=dsa.DSAttentionSubmodules(indexer=indexer))


def freeze_indexers(model: torch.nn.Module) -> None:
    """Keep every indexer's weights as loaded: without an indexer loss nothing trains them (transformers runs its
    indexer without gradients), and a frozen one takes no weight decay either."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    for module in model.modules():
        if isinstance(module, DSAIndexer):
            module.requires_grad_(False)
