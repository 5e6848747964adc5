"""The DeepSeek-V3 family on megatron-core: `deepseek_v3` (DeepSeek-V3/R1, Kimi-K2, Moonlight), its GLM-4.7-Flash
twin `glm4_moe_lite` and GLM-5 `glm_moe_dsa` (with sparse attention: `glm_moe_dsa.py`). Multi-latent attention
(MLA), a sigmoid router with an expert bias and grouped top-k, shared experts, dense first layers, YaRN rotary
scaling: their ModelArch fields from the HF config, the MLA fields of megatron-core's MLATransformerConfig, and the
HF <-> Megatron map of the attention weights (the megatron-core modules the local spec takes for MLA:
backends/megatron/mla.py).

Attention weights (HF DeepseekV3Attention -> MLASelfAttention): q_a_proj -> linear_q_down_proj, q_a_layernorm ->
q_layernorm, q_b_proj -> linear_q_up_proj (q_proj -> linear_q_proj without a q rank), kv_a_proj_with_mqa ->
linear_kv_down_proj, kv_a_layernorm -> kv_layernorm, kv_b_proj -> linear_kv_up_proj, o_proj -> linear_proj (as
convert.py's). In the local spec the q projections and the kv up-projection are column-parallel (TP rank r: chunk r of
dim 0), the q down-projection gathered again before its norm, and the kv down-projection is whole on every rank
(`backends/megatron/mla.py`); the Transformer Engine spec keeps both down-projections whole and fuses the two norms into
the up-projections. HF keeps each head's rope dimensions interleaved,
which megatron-core's MLA rotary expects (it de-interleaves them as transformers does), so no row is permuted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from services.common.errors import InvalidArgument

# Megatron sub-name (under self_attention.) -> HF sub-name (under self_attn.)
MLA_RENAMED = {
    "linear_q_proj.weight": "q_proj.weight",
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
}
NORMS = ("q_layernorm.weight", "kv_layernorm.weight")  # replicated
DOWN_PROJS = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")  # whole on every rank in the TE spec
TE_NORMS = {"q_layernorm.weight": "linear_q_up_proj.layer_norm_weight",
            "kv_layernorm.weight": "linear_kv_up_proj.layer_norm_weight"}
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm / Glm4MoeLiteRMSNorm default
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def arch_fields(get: Callable[..., Any]) -> dict[str, Any]:
    """ModelArch's fields of a deepseek_v3 or glm4_moe_lite config (`get(key, default)`; mla and yarn as the
    fields of MLAShape and YarnScaling); what megatron-core cannot build raises InvalidArgument naming the field."""
    model_type = get("model_type")

    def refuse(problem: str) -> InvalidArgument:
        return InvalidArgument(f"megatron backend: {model_type} {problem}")

    if get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act {get('hidden_act')!r} is not supported (silu only)")
    if get("attention_bias", False):
        raise refuse("attention_bias: megatron-core's multi-latent attention projections have no bias")
    if not get("rope_interleave", True):
        raise refuse("rope_interleave false: megatron-core's multi-latent attention takes interleaved rope weights")
    num_layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    rope = get("rope_parameters") or get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
    yarn = None
    if rope_type == "yarn":
        values = {key: float(rope.get(key) or default) for key, default in YARN_DEFAULTS.items()}
        if rope.get("mscale_all_dim") in (None, 0) and values["mscale"] != 1.0:
            raise refuse("yarn mscale without mscale_all_dim: transformers then ignores mscale, megatron-core does not")
        yarn = dict(factor=float(rope["factor"]), original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings") or get("max_position_embeddings")), **values)
    elif rope_type != "default":
        raise refuse(f"rope {rope!r} is not supported (default or yarn)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("partial_rotary_factor: multi-latent attention rotates all qk_rope_head_dim dimensions")
    if model_type in ("glm4_moe_lite", "glm_moe_dsa"):
        kinds = list(get("mlp_layer_types") or ["sparse"] * num_layers)
        moe_layers = tuple(kind == "sparse" for kind in kinds)
    else:
        moe_layers = tuple(i >= (get("first_k_dense_replace") or 0) for i in range(num_layers))
    return dict(
        model_type=model_type, vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        ffn_hidden_size=get("intermediate_size"), num_layers=num_layers, num_attention_heads=heads,
        num_query_groups=heads, head_dim=get("v_head_dim"), norm_epsilon=get("rms_norm_eps"), rope_theta=rope_theta,
        rope_scaling_factor=None, max_position_embeddings=get("max_position_embeddings"), qkv_bias=False,
        qk_layernorm=False, tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        **sigmoid_moe_fields(get, refuse, moe_layers),
        mla=dict(q_lora_rank=get("q_lora_rank"), kv_lora_rank=get("kv_lora_rank"),
                 qk_nope_head_dim=get("qk_nope_head_dim"), qk_rope_head_dim=get("qk_rope_head_dim"),
                 v_head_dim=get("v_head_dim")),
        yarn=yarn, **_sparse_attention(get, refuse))


def _sparse_attention(get: Callable[..., Any], refuse: Callable[[str], InvalidArgument]) -> dict[str, Any]:
    """GLM-5's DeepSeek sparse attention fields (`glm_moe_dsa.py`); none for the dense-attention families."""
    if get("model_type") != "glm_moe_dsa":
        return {}
    from services.trainer.models import glm_moe_dsa

    return {"dsa": glm_moe_dsa.sparse_attention_fields(get, refuse)}


def sigmoid_moe_fields(get: Callable[..., Any], refuse: Callable[[str], InvalidArgument],
                       moe_layers: tuple[bool, ...]) -> dict[str, Any]:
    """ModelArch's MoE fields of a DeepSeek-V3-style router (DeepSeek-V3, GLM-4.5/4.7 and GLM-4.7-Flash): sigmoid
    scores, an expert bias that chooses but does not weigh, grouped top-k, the top-k weights renormalized and
    scaled, n_shared_experts always-on experts of the routed ones' size, `moe_layers` the MoE ones."""
    experts, topk = get("n_routed_experts") or 0, get("num_experts_per_tok") or 0
    if not experts:
        return {}
    groups, group_topk = get("n_group") or 1, get("topk_group") or 1
    if groups > 1 and (topk % group_topk or topk // group_topk != 2):
        # transformers scores a group by its best two experts, megatron-core by its best topk / group_topk
        raise refuse(f"grouped top-k with num_experts_per_tok {topk} and topk_group {group_topk}: megatron-core scores "
                     "each group by its best num_experts_per_tok / topk_group experts, transformers by its best 2")
    if topk > 1 and not get("norm_topk_prob", True):
        raise refuse("norm_topk_prob false: megatron-core's sigmoid router always normalises the top-k weights")
    scaling = get("routed_scaling_factor")
    return dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=get("moe_intermediate_size") or 0,
                moe_router_score_function="sigmoid", moe_router_expert_bias=True,
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=group_topk if groups > 1 else None,
                moe_router_topk_scaling_factor=float(scaling) if scaling and scaling != 1.0 else None,
                moe_shared_expert_intermediate_size=(get("n_shared_experts") or 0) * (get("moe_intermediate_size")
                                                                                      or 0),
                moe_layers=moe_layers)


def config_fields(arch) -> dict[str, Any]:
    """MLATransformerConfig's multi-latent attention and rotary fields of `arch`."""
    mla = arch.mla
    fields: dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        qk_layernorm=True)
    if arch.yarn is None:
        return {**fields, "rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}
    yarn = arch.yarn
    return {**fields, "rope_type": "yarn", "rotary_scaling_factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim}


def hf_to_megatron_attention(hf: Mapping[str, torch.Tensor], arch, src: str, dst: str,
                             shard: Callable[[torch.Tensor], torch.Tensor], *,
                             te_names: bool) -> dict[str, torch.Tensor]:
    """One layer's MLA weights (this TP rank's shards) from the HF layer `src` into the Megatron layer `dst`."""
    out = {}
    for mg_sub, hf_sub in MLA_RENAMED.items():
        name = f"{src}self_attn.{hf_sub}"
        if name not in hf:
            if mg_sub in ("linear_q_proj.weight",) or arch.mla.q_lora_rank is None:
                continue
            raise KeyError(name)
        tensor = hf[name]
        # the kv down-projection is whole in either spec (`LatentKVDownProjection` in the local one)
        whole = mg_sub in NORMS or mg_sub == DOWN_PROJS[1] or (te_names and mg_sub in DOWN_PROJS)
        key = TE_NORMS.get(mg_sub, mg_sub) if te_names else mg_sub
        out[f"{dst}self_attention.{key}"] = tensor.clone().contiguous() if whole else shard(tensor)
    return out


def local_sub(sub: str) -> str:
    """The local-spec name of a Transformer Engine spec MLA sub-name (fused norms map back)."""
    for local, te in TE_NORMS.items():
        if sub == f"self_attention.{te}":
            return f"self_attention.{local}"
    return sub


def megatron_to_hf_attention(sub: str, shards: list[torch.Tensor],
                             prefix: str) -> list[tuple[str, torch.Tensor]] | None:
    """The HF (name, tensor) of one MLA parameter (`sub` under the layer, its TP shards); None: not an MLA one."""
    name = sub.removeprefix("self_attention.")
    if not sub.startswith("self_attention.") or name not in MLA_RENAMED:
        return None
    tensor = shards[0] if name in NORMS or len(shards) == 1 else torch.cat(list(shards))
    return [(f"{prefix}self_attn.{MLA_RENAMED[name]}", tensor)]

