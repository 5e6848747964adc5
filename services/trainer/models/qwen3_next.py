"""The gated delta-net families (`qwen3_next`: Qwen3-Next; `qwen3_5`, `qwen3_5_moe`: Qwen3.5's language models) on
megatron-core: a hybrid stack of gated delta-net (linear attention) layers and full-attention ones as the config's
`layer_types` says, attention with an output gate and per-head q/k norms, RMSNorms scaling by 1 + weight, and (MoE)
softmax-routed experts beside a shared expert behind a sigmoid gate. Its ModelArch fields, and the weight names and
layouts that differ from convert.py's:

- linear_attn.* -> self_attention.{in_proj, conv1d, A_log, dt_bias, out_norm, out_proj}: megatron-core's in_proj on
  TP rank r is cat(q_r, k_r, v_r, z_r, b_r, a_r), each part chunk r of its HF tensor (Qwen3.5: in_proj_qkv, _z, _b,
  _a; Qwen3-Next: in_proj_qkvz and in_proj_ba grouped per key head); conv1d cat(q_r, k_r, v_r) of the HF channels;
  A_log and dt_bias chunk r; the gated norm replicated.
- self_attn.q_proj [heads · 2 · head_dim] holds each head's query then its gate: megatron-core's linear_qkv takes,
  per query group, the group's queries, then their gates, then the key and the value.
- mlp.shared_expert.* -> mlp.shared_experts.* (TP-cut as a dense MLP), mlp.shared_expert_gate.weight ->
  mlp.shared_experts.gate_weight (replicated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from services.common.errors import InvalidArgument
from services.trainer.models.gqa import gqa_fields

HF_SHARED_EXPERT = "mlp.shared_expert."
SHARED_EXPERT_GATE = {"mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight"}
# megatron-core's GatedDeltaNet parameters (under self_attention.) -> Qwen3.5's (under linear_attn.), where renamed
GDN = "self_attention."
GDN_RENAMED = {"A_log": "A_log", "dt_bias": "dt_bias", "out_norm.weight": "norm.weight",
               "out_proj.weight": "out_proj.weight", "conv1d.weight": "conv1d.weight"}
IN_PROJ_PARTS = ("q", "k", "v", "z", "b", "a")
# transformers' defaults (the same in the three config classes), for a config.json that leaves fields out
LINEAR_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32}
FULL_ATTENTION_INTERVAL, PARTIAL_ROTARY_FACTOR = 4, 0.25


def arch_fields(get: Callable[..., Any], family: str) -> dict[str, Any]:
    """ModelArch's fields of a qwen3_next / qwen3_5 / qwen3_5_moe (language model) config; what megatron-core cannot
    build raises InvalidArgument naming the field."""
    if get("attention_bias", False):
        raise InvalidArgument(f"megatron backend: {family} attention_bias is not supported")
    num_layers = get("num_hidden_layers")
    interval = get("full_attention_interval") or FULL_ATTENTION_INTERVAL  # every interval-th layer full attention
    layer_types = list(get("layer_types") or ("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                              for i in range(num_layers)))
    other = sorted({kind for kind in layer_types if kind not in ("linear_attention", "full_attention")})
    if len(layer_types) != num_layers or other:
        raise InvalidArgument(f"megatron backend: {family} layer_types must name linear_attention or full_attention "
                              f"for each of the {num_layers} layers, got {layer_types}")
    fields = gqa_fields(get, family, partial_rotary_default=PARTIAL_ROTARY_FACTOR)
    linear = {name: get(name) or default for name, default in LINEAR_DEFAULTS.items()}
    fields.update(
        qkv_bias=False, qk_layernorm=True, attention_output_gate=True, zero_centered_norms=True,
        linear_layers=tuple(kind == "linear_attention" for kind in layer_types),
        linear_attention={name.removeprefix("linear_"): value for name, value in linear.items()})
    if fields["linear_attention"]["num_value_heads"] % fields["linear_attention"]["num_key_heads"]:
        raise InvalidArgument(f"megatron backend: {family} linear_num_value_heads must be a multiple of "
                              "linear_num_key_heads")
    num_experts = get("num_experts") or 0
    if not num_experts:
        return fields
    moe_ffn = get("moe_intermediate_size")
    fields.update(num_experts=num_experts, moe_router_topk=get("num_experts_per_tok"), moe_ffn_hidden_size=moe_ffn,
                  # Qwen3.5-MoE always renormalizes the top-k weights; Qwen3-Next as norm_topk_prob says
                  moe_router_pre_softmax=family == "qwen3_next" and not get("norm_topk_prob", True),
                  moe_shared_expert_intermediate_size=get("shared_expert_intermediate_size") or 0,
                  ffn_hidden_size=get("intermediate_size") or moe_ffn)
    fields["moe_shared_expert_gate"] = bool(fields["moe_shared_expert_intermediate_size"])
    # Qwen3-Next's dense layers: mlp_only_layers, or off the decoder_sparse_step grid
    sparse_step, dense = get("decoder_sparse_step", 1) or 1, set(get("mlp_only_layers") or ())
    pattern = tuple(i not in dense and (i + 1) % sparse_step == 0 for i in range(num_layers))
    if not all(pattern):
        fields["moe_layers"] = pattern
    return fields


class CheckpointNames(Mapping):
    """A checkpoint's tensors under the causal LM's names (model.layers.*), whether its files hold those or a
    multimodal Qwen3.5 checkpoint's language model (model.language_model.layers.*; its vision tower is not read)."""

    def __init__(self, tensors: Mapping) -> None:
        self.tensors = tensors

    def _multimodal(self, name: str) -> str:
        return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name

    def __getitem__(self, name: str):
        return self.tensors[name] if name in self.tensors else self.tensors[self._multimodal(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.tensors or self._multimodal(name) in self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def _next_split(hf: Mapping[str, torch.Tensor], gdn: str, shape) -> dict[str, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz [per key head: q, k, v, z] and in_proj_ba [per key head: b, a] as the six full
    Qwen3.5-style projections (heads in order)."""
    nk, ratio = shape.num_key_heads, shape.num_value_heads // shape.num_key_heads
    dk, dv = shape.key_head_dim, shape.value_head_dim
    qkvz = hf[gdn + "in_proj_qkvz.weight"]
    hidden = qkvz.shape[-1]
    q, k, v, z = qkvz.reshape(nk, 2 * dk + 2 * ratio * dv, hidden).split([dk, dk, ratio * dv, ratio * dv], dim=1)
    b, a = hf[gdn + "in_proj_ba.weight"].reshape(nk, 2 * ratio, hidden).split([ratio, ratio], dim=1)
    return {name: t.reshape(-1, hidden) for name, t in zip(IN_PROJ_PARTS, (q, k, v, z, b, a), strict=True)}


def _next_join(parts: dict[str, torch.Tensor], shape) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `_next_split`: (in_proj_qkvz, in_proj_ba) sub-names with their tensors."""
    nk = shape.num_key_heads
    hidden = parts["q"].shape[-1]
    grouped = {name: parts[name].reshape(nk, -1, hidden) for name in IN_PROJ_PARTS}
    qkvz = torch.cat([grouped[name] for name in "qkvz"], dim=1).reshape(-1, hidden)
    ba = torch.cat([grouped["b"], grouped["a"]], dim=1).reshape(-1, hidden)
    return [("in_proj_qkvz.weight", qkvz), ("in_proj_ba.weight", ba)]


def _hf_in_proj(hf: Mapping[str, torch.Tensor], arch, gdn: str) -> dict[str, torch.Tensor]:
    """The six HF input projections of a gated delta-net (q, k, v, z, b, a), whole."""
    shape = arch.linear_attention
    if gdn + "in_proj_qkvz.weight" in hf:
        return _next_split(hf, gdn, shape)
    qk = shape.num_key_heads * shape.key_head_dim
    q, k, v = hf[gdn + "in_proj_qkv.weight"].split([qk, qk, shape.num_value_heads * shape.value_head_dim])
    return {"q": q, "k": k, "v": v, **{p: hf[f"{gdn}in_proj_{p}.weight"] for p in "zba"}}


def hf_to_megatron_linear_attention(hf: Mapping[str, torch.Tensor], arch, src: str, dst: str,
                                    shard: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """One gated delta-net layer's parameters (this TP rank's shards) but its input norm."""
    gdn = src + "linear_attn."
    parts = _hf_in_proj(hf, arch, gdn)
    out = {dst + GDN + "in_proj.weight": torch.cat([shard(parts[p]) for p in IN_PROJ_PARTS])}
    conv = hf[gdn + "conv1d.weight"]
    qk = arch.linear_attention.num_key_heads * arch.linear_attention.key_head_dim
    out[dst + GDN + "conv1d.weight"] = torch.cat([shard(c) for c in conv.split([qk, qk, conv.shape[0] - 2 * qk])])
    for name in ("A_log", "dt_bias"):
        out[dst + GDN + name] = shard(hf[gdn + name])
    out[dst + GDN + "out_norm.weight"] = hf[gdn + "norm.weight"].clone().contiguous()
    out[dst + GDN + "out_proj.weight"] = shard(hf[gdn + "out_proj.weight"], dim=1)
    return out


def megatron_to_hf_linear_attention(sub: str, shards: list[torch.Tensor], arch,
                                    prefix: str) -> list[tuple[str, torch.Tensor]] | None:
    """The HF (name, tensor) pairs of one gated delta-net parameter given its TP shards; None: not one."""
    if not sub.startswith(GDN):
        return None
    name, shape, gdn = sub.removeprefix(GDN), arch.linear_attention, prefix + "linear_attn."
    tp = len(shards)
    qk, v = shape.num_key_heads * shape.key_head_dim, shape.num_value_heads * shape.value_head_dim
    if name == "in_proj.weight":
        sizes = [size // tp for size in (qk, qk, v, v, shape.num_value_heads, shape.num_value_heads)]
        pieces = [s.split(sizes) for s in shards]
        parts = {p: torch.cat([piece[i] for piece in pieces]) for i, p in enumerate(IN_PROJ_PARTS)}
        if arch.model_type == "qwen3_next":
            return [(gdn + n, t) for n, t in _next_join(parts, shape)]
        return [(gdn + "in_proj_qkv.weight", torch.cat([parts["q"], parts["k"], parts["v"]])),
                *((f"{gdn}in_proj_{p}.weight", parts[p]) for p in "zba")]
    if name == "conv1d.weight":
        pieces = [s.split([qk // tp, qk // tp, v // tp]) for s in shards]
        return [(gdn + "conv1d.weight", torch.cat([torch.cat([piece[i] for piece in pieces]) for i in range(3)]))]
    if name in ("A_log", "dt_bias"):
        return [(gdn + name, torch.cat(shards))]
    if name == "out_proj.weight":
        return [(gdn + GDN_RENAMED[name], torch.cat(shards, dim=1))]
    if name == "out_norm.weight":
        return [(gdn + GDN_RENAMED[name], shards[0])]
    return None


def split_gated_q(arch, q_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's q_proj [heads · 2 · head_dim, ...] (each head's query, then its gate) -> (queries, gates), each
    [heads · head_dim, ...]."""
    tail = q_proj.shape[1:]
    q, gate = q_proj.reshape(arch.num_attention_heads, 2, arch.head_dim, *tail).unbind(1)
    return q.reshape(-1, *tail), gate.reshape(-1, *tail)


def join_gated_q(arch, q: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_gated_q`."""
    tail = q.shape[1:]
    heads = arch.num_attention_heads
    return torch.stack([q.reshape(heads, arch.head_dim, *tail), gate.reshape(heads, arch.head_dim, *tail)],
                       dim=1).reshape(-1, *tail)
