"""The GLM-4 dense family (`glm4`: GLM-4-9B-0414, GLM-Z1) on megatron-core: grouped-query attention with q/k/v bias,
RoPE on the first half of each head in interleaved (even, odd) pairs, an RMSNorm after attention and after the MLP
before each residual add (`backends/megatron/post_norm.py`), and a fused gate/up projection. Its ModelArch fields and
the weight names that differ from convert.py's: post_self_attn_layernorm -> self_attention.linear_proj.post_norm,
post_mlp_layernorm -> mlp.linear_fc2.post_norm (replicated), mlp.gate_up_proj [2·I, H] -> linear_fc1 (TP rank r:
cat(gate chunk r, up chunk r)).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from services.trainer.models.gqa import gqa_fields

POST_NORMS = {"self_attention.linear_proj.post_norm.weight": "post_self_attn_layernorm.weight",
              "mlp.linear_fc2.post_norm.weight": "post_mlp_layernorm.weight"}


def arch_fields(get: Callable[..., Any]) -> dict[str, Any]:
    """ModelArch's fields of a glm4 config (`get(key, default)`); what megatron-core cannot build raises
    InvalidArgument naming the field."""
    return dict(gqa_fields(get, "glm4", partial_rotary_default=0.5), rotary_interleaved=True, post_norms=True,
                qkv_bias=bool(get("attention_bias", True)), qk_layernorm=False)


def hf_to_megatron_layer(hf: Mapping[str, torch.Tensor], src: str, dst: str,
                         shard: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's post norms and fused gate/up projection (this TP rank's shard)."""
    out = {dst + mg: hf[src + name].clone().contiguous() for mg, name in POST_NORMS.items()}
    gate, up = hf[src + "mlp.gate_up_proj.weight"].chunk(2)
    out[dst + "mlp.linear_fc1.weight"] = torch.cat([shard(gate), shard(up)])
    return out


def megatron_to_hf_layer(sub: str, shards: list[torch.Tensor], prefix: str) -> list[tuple[str, torch.Tensor]] | None:
    """The HF (name, tensor) of one glm4-specific parameter (`sub` under the layer); None: not one."""
    if sub in POST_NORMS:
        return [(prefix + POST_NORMS[sub], shards[0])]
    if sub == "mlp.linear_fc1.weight":
        gates, ups = zip(*(s.chunk(2) for s in shards), strict=True)
        return [(prefix + "mlp.gate_up_proj.weight", torch.cat([*gates, *ups]))]
    return None
