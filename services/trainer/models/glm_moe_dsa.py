"""GLM-5 (`glm_moe_dsa`) on megatron-core: DeepSeek-V3's multi-latent attention and sigmoid-routed MoE
(`deepseek_v3.py`) with DeepSeek sparse attention, megatron-core's DSAttention (`backends/megatron/dsa.py`): a
lightning indexer scores every earlier token and each query attends to the index_topk best. Its ModelArch fields
from the HF config, and the HF <-> Megatron map of the indexer's weights.

Indexer weights (HF self_attn.indexer -> self_attention.core_attention.indexer): wq_b -> linear_wq_b, wk ->
linear_wk, k_norm -> k_norm (a LayerNorm with bias), weights_proj -> linear_weights_proj; all whole on every TP rank.
Each indexer head's dimensions are [rope | rest] in transformers and [rest | rope] in megatron-core, so the rows of
wq_b (per head), wk and the k_norm's weight and bias are rotated by qk_rope_head_dim; the scores, dot products of
queries and keys rotated alike, do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

HF_INDEXER = "self_attn.indexer."
MG_INDEXER = "self_attention.core_attention.indexer."
# Megatron sub-name (under MG_INDEXER) -> HF sub-name (under HF_INDEXER)
INDEXER_RENAMED = {"linear_wq_b.weight": "wq_b.weight", "linear_wk.weight": "wk.weight",
                   "k_norm.weight": "k_norm.weight", "k_norm.bias": "k_norm.bias",
                   "linear_weights_proj.weight": "weights_proj.weight"}
INDEXER_KEY_NORM_EPS = 1e-6  # transformers' GlmMoeDsaIndexer k_norm, whatever rms_norm_eps says


def config_reader(config: Any) -> Callable[..., Any]:
    """`get(key, default)` over a GLM-5 config as transformers' GlmMoeDsaConfig reads a config.json dict (its
    defaults, and the per-layer lists it derives: mlp_layer_types from first_k_dense_replace, indexer_types from
    index_topk_freq); a config object as it is."""
    if isinstance(config, dict):
        from transformers import GlmMoeDsaConfig

        config = GlmMoeDsaConfig(**config)
    return lambda key, default=None: getattr(config, key, default)


def sparse_attention_fields(get, refuse) -> dict[str, int]:
    """SparseAttentionShape's fields of a resolved GLM-5 config (`get(key, default)`); what megatron-core's
    DSAttention cannot build raises InvalidArgument (`refuse(problem)`) naming the field."""
    shared = [i for i, kind in enumerate(get("indexer_types") or []) if kind != "full"]
    if shared:
        raise refuse(f"indexer_types 'shared' (layers {shared} reuse an earlier layer's top-k): megatron-core "
                     "0.16.1's DSAttention runs every layer's own indexer (no cross-layer top-k sharing)")
    if not get("q_lora_rank"):
        raise refuse("q_lora_rank: DeepSeek sparse attention's indexer reads the query latent")
    head_dim, rope_dim = get("index_head_dim"), get("qk_rope_head_dim")
    if head_dim & (head_dim - 1) or head_dim < rope_dim:
        raise refuse(f"index_head_dim {head_dim}: megatron-core's indexer Hadamard-rotates its queries and keys, "
                     f"which needs a power of two of at least qk_rope_head_dim {rope_dim}")
    return dict(index_n_heads=get("index_n_heads"), index_head_dim=head_dim, index_topk=get("index_topk"))


def config_fields(arch) -> dict[str, Any]:
    """MLATransformerConfig's sparse-attention fields of `arch` (none without it). No indexer KL loss: transformers
    does not train the indexer (backends/megatron/dsa.py freezes it)."""
    if arch.dsa is None:
        return {}
    return dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=arch.dsa.index_n_heads,
                dsa_indexer_head_dim=arch.dsa.index_head_dim, dsa_indexer_topk=arch.dsa.index_topk,
                dsa_indexer_loss_coeff=0.0)


def _rope_last(arch) -> torch.Tensor:
    """The permutation of one indexer head's dimensions from transformers' [rope | rest] to megatron's [rest | rope]."""
    rope, dim = arch.mla.qk_rope_head_dim, arch.dsa.index_head_dim
    return torch.cat([torch.arange(rope, dim), torch.arange(rope)])


def _per_head_rows(tensor: torch.Tensor, order: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`tensor`'s rows (dim 0: heads of head_dim rows each) with each head's rows in `order`."""
    heads = tensor.shape[0] // head_dim
    return tensor.reshape(heads, head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape).contiguous()


def hf_to_megatron_indexer(hf: Mapping[str, torch.Tensor], arch, src: str, dst: str) -> dict[str, torch.Tensor]:
    """One layer's indexer weights (whole on every TP rank) from the HF layer `src` into the Megatron layer `dst`."""
    order = _rope_last(arch)
    out = {}
    for mg_sub, hf_sub in INDEXER_RENAMED.items():
        tensor = hf[src + HF_INDEXER + hf_sub]
        if mg_sub != "linear_weights_proj.weight":
            tensor = _per_head_rows(tensor, order, arch.dsa.index_head_dim)
        out[dst + MG_INDEXER + mg_sub] = tensor.clone().contiguous()
    return out


def megatron_to_hf_indexer(sub: str, shards: list[torch.Tensor], arch,
                           prefix: str) -> list[tuple[str, torch.Tensor]] | None:
    """The HF (name, tensor) of one indexer parameter (`sub` under the layer; whole on every TP rank); None: not an
    indexer one."""
    name = sub.removeprefix(MG_INDEXER)
    if not sub.startswith(MG_INDEXER) or name not in INDEXER_RENAMED:
        return None
    tensor = shards[0]
    if name != "linear_weights_proj.weight":
        tensor = _per_head_rows(tensor, torch.argsort(_rope_last(arch)), arch.dsa.index_head_dim)
    return [(prefix + HF_INDEXER + INDEXER_RENAMED[name], tensor)]
