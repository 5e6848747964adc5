"""HF <-> Megatron GPTModel weights for Qwen2, Qwen3, Qwen3-MoE and Llama, (attention from `deepseek_v3.py`)
DeepSeek-V3, GLM-4.7-Flash and GLM-5 (its sparse attention's indexer from `glm_moe_dsa.py`), and (gated delta-nets
from `qwen3_next.py`) Qwen3-Next and Qwen3.5: names, fused layouts, TP shards, vocab padding, experts.

`hf_to_megatron` cuts one rank's shard out of full HF tensors; `megatron_to_hf` turns the TP shards of one
Megatron parameter back into HF tensors; `gather_hf_weights` runs that over the process groups so the source rank
yields every HF weight once. Layouts (slime's megatron_to_hf, Megatron's attention):
- linear_qkv: per query group g, rows [q heads of g (heads_per_group·head_dim), k_g (head_dim), v_g (head_dim)]
  (with an output gate, the gates of g's heads after its queries); TP rank r holds query groups
  [r·G/tp, (r+1)·G/tp), i.e. chunk r of dim 0.
- linear_fc1: on TP rank r, cat(gate chunk r, up chunk r) along dim 0.
- linear_proj, linear_fc2: chunk r of dim 1. Embedding and output layer: the vocab padded with zero rows, chunk r
  of dim 0. Norms are replicated.
- MoE layers: mlp.router <- mlp.gate; expert e is local expert e - r·E/ep of expert-parallel rank r, its linear_fc1
  cat(gate_e, up_e), its linear_fc2 down_e; router and experts are whole on every TP rank (expert TP 1). HF
  checkpoints on disk name each expert (mlp.experts.{e}.gate_proj);
  transformers' models in memory, and so the engines' weight names, hold them fused (mlp.experts.gate_up_proj
  [E, 2·I, H], mlp.experts.down_proj [E, H, I]): both are read, the fused names are written. A sigmoid router's
  expert bias (mlp.gate.e_score_correction_bias, a buffer in both) maps to mlp.router.expert_bias; shared experts
  (mlp.shared_experts.*) are TP-sharded as a dense MLP is. Layers before the first MoE one are dense.
- MTP layers (`models/mtp.py`'s HF names) <-> mtp.layers.{i}: their norms replicated, eh_proj column-parallel (chunk r
  of dim 0; MiMo's input_proj has its halves the other way round), transformer_layer.* as a decoder layer's
  (Qwen3-Next's and Qwen3.5's: a full-attention one). Under pipeline parallelism the last stage holds them with its
  own copy of the embedding, loaded and never exported.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from services.trainer.models import deepseek_v3, glm4, glm_moe_dsa, minimax_m2, mtp, qwen3_next, vision_language
from services.trainer.models.arch import ModelArch

HF_LAYER = "model.layers.{}."
MG_LAYER = "decoder.layers.{}."
MTP_LAYER = "mtp.layers.{}."  # megatron-core's multi-token-prediction layers (`models/mtp.py` names their HF tensors)
# Megatron sub-name -> HF sub-name, for per-layer tensors that are only renamed (local spec names).
RENAMED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# With the Transformer Engine spec the pre-attention and pre-MLP norms are fused into the next linear layer.
TE_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")  # TP-split along dim 1
QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")  # Qwen3 only
DENSE_MLP = ("mlp.linear_fc2.weight",)  # a MoE layer has experts instead
LOCAL_EXPERT = "mlp.experts.local_experts."
EXPERT_BIAS = "mlp.router.expert_bias"  # a buffer: the router's float32 bias of the scores that choose experts
HF_SHARED_EXPERTS = "mlp.shared_experts."  # DeepSeek-V3's and GLM's always-on MLP of a MoE layer
FC1 = ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight")  # cat(gate chunk r, up chunk r) on rank r


def weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A GPTModel's weights that an HF checkpoint holds: its parameters and its routers' expert biases."""
    return [*module.named_parameters(), *((name, buf) for name, buf in module.named_buffers()
                                          if name.endswith(EXPERT_BIAS))]


def layer_offset(arch: ModelArch, *, pp_rank: int, pp_size: int) -> int:
    """Global index of this pipeline stage's first layer (split evenly, or as `arch.stage_layers` says)."""
    return arch.stage_layer_range(pp_rank, pp_size).start


def _te_name(sub: str, te_names: bool) -> str:
    return TE_RENAMES.get(sub, sub) if te_names else sub


def _local_sub(sub: str) -> str:
    """The local-spec sub-name of a per-layer Megatron sub-name (TE fused norm names map back)."""
    for local, te in TE_RENAMES.items():
        if sub == te:
            return local
    return sub


def _pad_vocab(weight: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    extra = padded_vocab_size - weight.shape[0]
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])]) if extra else weight


def _fuse_qkv(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q [H·d, ...], k/v [G·d, ...] -> Megatron linear_qkv [(H + 2G)·d, ...] in per-query-group order; with an
    output gate HF's q holds each head's query and gate, and each group's gates follow its queries."""
    groups, d = arch.num_query_groups, arch.head_dim
    tail = q.shape[1:]
    queries = [q]
    if arch.attention_output_gate:
        queries = list(qwen3_next.split_gated_q(arch, q))
    queries = [t.reshape(groups, arch.heads_per_group * d, *tail) for t in queries]
    k, v = k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)
    return torch.cat([*queries, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(arch: ModelArch, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_fuse_qkv` on the full (TP-gathered) tensor."""
    groups, d = arch.num_query_groups, arch.head_dim
    tail = qkv.shape[1:]
    gated = int(arch.attention_output_gate)
    grouped = qkv.reshape(groups, ((1 + gated) * arch.heads_per_group + 2) * d, *tail)
    *queries, k, v = grouped.split([arch.heads_per_group * d] * (1 + gated) + [d, d], dim=1)
    queries = [t.reshape(-1, *tail) for t in queries]
    q = qwen3_next.join_gated_q(arch, *queries) if gated else queries[0]
    return q, k.reshape(-1, *tail), v.reshape(-1, *tail)


def _hf_shared_experts(arch: ModelArch) -> str:
    """The HF name (under the layer) of a MoE layer's always-on MLP: DeepSeek's and GLM's shared_experts, Qwen's
    shared_expert."""
    return qwen3_next.HF_SHARED_EXPERT if arch.moe_shared_expert_gate else HF_SHARED_EXPERTS


def _hf_expert_bias(arch: ModelArch) -> str:
    """The HF name (under the layer) of a sigmoid router's expert bias: on the gate, or on MiniMax-M2's MoE block."""
    return minimax_m2.HF_EXPERT_BIAS if arch.model_type == "minimax_m2" else "mlp.gate.e_score_correction_bias"


def _hf_expert(hf: Mapping[str, torch.Tensor], layer: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e of an HF MoE layer as Megatron's (linear_fc1, linear_fc2), from fused or per-expert HF names."""
    fused = layer + "mlp.experts.gate_up_proj"
    if fused in hf:
        return hf[fused][e].clone().contiguous(), hf[layer + "mlp.experts.down_proj"][e].clone().contiguous()
    expert = f"{layer}mlp.experts.{e}."
    return (torch.cat([hf[expert + "gate_proj.weight"], hf[expert + "up_proj.weight"]]),
            hf[expert + "down_proj.weight"].clone().contiguous())


def _moe_layer(hf: Mapping[str, torch.Tensor], arch: ModelArch, src: str, dst: str, *, ep_rank: int,
               ep_size: int, shard, etp_rank: int = 0, etp_size: int = 1) -> dict[str, torch.Tensor]:
    """A MoE layer's router (and its expert bias), its shared experts (this TP rank's shard, as a dense MLP's) and
    this expert-parallel rank's experts."""
    out = {dst + "mlp.router.weight": hf[src + "mlp.gate.weight"].clone().contiguous()}
    if arch.moe_router_expert_bias:
        out[dst + EXPERT_BIAS] = hf[src + _hf_expert_bias(arch)].clone().contiguous()
    if arch.moe_shared_expert_intermediate_size:
        shared = src + _hf_shared_experts(arch)
        out[dst + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [shard(hf[shared + "gate_proj.weight"]), shard(hf[shared + "up_proj.weight"])])
        out[dst + "mlp.shared_experts.linear_fc2.weight"] = shard(hf[shared + "down_proj.weight"], dim=1)
    if arch.moe_shared_expert_gate:
        out.update({dst + mg: hf[src + name].clone().contiguous()
                    for mg, name in qwen3_next.SHARED_EXPERT_GATE.items()})
    local = arch.num_experts // ep_size
    for i in range(local):
        fc1, fc2 = _hf_expert(hf, src, ep_rank * local + i)
        if etp_size > 1:  # expert tensor parallelism: each expert cut as a dense MLP is over the expert-TP ranks
            gate, up = fc1.chunk(2)
            fc1 = torch.cat([gate.chunk(etp_size)[etp_rank], up.chunk(etp_size)[etp_rank]]).contiguous()
            fc2 = fc2.chunk(etp_size, dim=1)[etp_rank].contiguous()
        out[f"{dst}mlp.experts.local_experts.{i}.linear_fc1.weight"] = fc1
        out[f"{dst}mlp.experts.local_experts.{i}.linear_fc2.weight"] = fc2
    return out


def hf_to_megatron(hf: Mapping[str, torch.Tensor], arch: ModelArch, *, tp_rank: int = 0, tp_size: int = 1,
                   pp_rank: int = 0, pp_size: int = 1, te_names: bool = False, ep_rank: int = 0,
                   ep_size: int = 1, etp_rank: int = 0, etp_size: int = 1) -> dict[str, torch.Tensor]:
    """This rank's GPTModel state (local layer indices, this TP shard) from full HF tensors (name -> tensor;
    only the names this stage needs are read). Tensors are fresh and contiguous."""

    def shard(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return tensor.chunk(tp_size, dim=dim)[tp_rank].clone().contiguous()

    out: dict[str, torch.Tensor] = {}
    if arch.model_type == "minimax_m2":
        hf = minimax_m2.CheckpointNames(hf)
    if arch.linear_attention is not None:
        hf = qwen3_next.CheckpointNames(hf)
    padded = arch.padded_vocab_size(tp_size)
    if arch.vision_model_type:  # the vision tower, whole, on the first stage (its HF names)
        hf = vision_language.CheckpointNames(hf)
        if pp_rank == 0:
            out.update({name: hf[name].clone().contiguous() for name in hf.tower_names()})
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = shard(_pad_vocab(hf["model.embed_tokens.weight"], padded))
    offset = layer_offset(arch, pp_rank=pp_rank, pp_size=pp_size)
    experts = dict(ep_rank=ep_rank, ep_size=ep_size, etp_rank=etp_rank, etp_size=etp_size)
    for local in range(len(arch.stage_layer_range(pp_rank, pp_size))):
        out.update(_layer_to_megatron(hf, arch, HF_LAYER.format(offset + local), MG_LAYER.format(local),
                                      moe=arch.is_moe_layer(offset + local),
                                      linear=arch.is_linear_layer(offset + local), shard=shard, te_names=te_names,
                                      **experts))
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone().contiguous()
        # Tied embeddings: the last stage keeps its own copy of the embedding as the output layer, unless the
        # same stage holds the embedding, the first's or the MTP layers' (then GPTModel has no output weight).
        if not arch.tie_word_embeddings:
            out["output_layer.weight"] = shard(_pad_vocab(hf["lm_head.weight"], padded))
        elif pp_size > 1 and not arch.mtp_num_layers:
            out["output_layer.weight"] = shard(_pad_vocab(hf["model.embed_tokens.weight"], padded))
        if pp_size > 1 and arch.mtp_num_layers:  # the MTP layers' copy of the embedding (tied: the output weight too)
            out["embedding.word_embeddings.weight"] = shard(_pad_vocab(hf["model.embed_tokens.weight"], padded))
        for index in range(arch.mtp_num_layers):  # megatron-core builds them on the last stage
            out.update(_mtp_to_megatron(hf, arch, index, shard=shard, te_names=te_names, **experts))
    return out


def _layer_to_megatron(hf: Mapping[str, torch.Tensor], arch: ModelArch, src: str, dst: str, *, moe: bool,
                       linear: bool = False, shard, te_names: bool, ep_rank: int, ep_size: int, etp_rank: int,
                       etp_size: int) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors (HF names under `src`) as this rank's Megatron tensors (names under `dst`);
    linear: a gated delta-net in attention's place."""
    out: dict[str, torch.Tensor] = {}
    for mg_sub, hf_sub in RENAMED.items():
        if (mg_sub in QK_NORMS and not (arch.qk_layernorm or arch.projection_qk_norm)) or \
                (mg_sub in DENSE_MLP and moe) or (linear and mg_sub.startswith("self_attention.")):
            continue
        tensor = hf[src + hf_sub]
        if mg_sub in QK_NORMS and arch.projection_qk_norm:  # cut over TP as the heads are
            out[dst + mg_sub] = shard(tensor)
            continue
        out[dst + _te_name(mg_sub, te_names)] = shard(tensor, dim=1) if mg_sub in ROW_PARALLEL else \
            tensor.clone().contiguous()
    attn = src + "self_attn."
    if linear:  # a gated delta-net in attention's place
        out.update(qwen3_next.hf_to_megatron_linear_attention(hf, arch, src, dst, shard))
    elif arch.mla is not None:
        out.update(deepseek_v3.hf_to_megatron_attention(hf, arch, src, dst, shard, te_names=te_names))
        if arch.dsa is not None:
            out.update(glm_moe_dsa.hf_to_megatron_indexer(hf, arch, src, dst))
    else:
        out[dst + "self_attention.linear_qkv.weight"] = shard(_fuse_qkv(
            arch, hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]))
    if arch.qkv_bias:
        out[dst + "self_attention.linear_qkv.bias"] = shard(_fuse_qkv(
            arch, hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"]))
    if arch.post_norms:
        out.update(glm4.hf_to_megatron_layer(hf, src, dst, shard))
        return out
    if moe:
        out.update(_moe_layer(hf, arch, src, dst, ep_rank=ep_rank, ep_size=ep_size, shard=shard,
                              etp_rank=etp_rank, etp_size=etp_size))
        return out
    gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
    out[dst + "mlp.linear_fc1.weight"] = torch.cat([shard(gate), shard(up)])
    return out


def _mtp_to_megatron(hf: Mapping[str, torch.Tensor], arch: ModelArch, index: int, *, shard, te_names: bool,
                     **experts: int) -> dict[str, torch.Tensor]:
    """MTP layer `index` (`models/mtp.py`'s HF names) as megatron-core's mtp.layers.{index}: its norms, its
    projection eh_proj (column-parallel: chunk r of dim 0) and its transformer layer, shaped as the last decoder
    layer."""
    src, dst = mtp.hf_prefix(arch.model_type, arch.num_layers, index), MTP_LAYER.format(index)
    own = mtp.own_prefix(arch.model_type, arch.num_layers, index)
    out = {}
    for mg_sub, hf_sub in mtp.hf_names(arch.model_type).items():
        tensor = hf[own + hf_sub]
        if mg_sub == "eh_proj.weight":
            if mtp.swaps_projection_halves(arch.model_type):
                hidden, embedding = tensor.chunk(2, dim=1)
                tensor = torch.cat([embedding, hidden], dim=1)
            tensor = shard(tensor)
        out[dst + mg_sub] = tensor.clone().contiguous()
    out.update(_layer_to_megatron(hf, arch, src, dst + "transformer_layer.", moe=arch.is_moe_layer(arch.num_layers - 1),
                                  shard=shard, te_names=te_names, **experts))
    return out


def megatron_to_hf(name: str, shards: Sequence[torch.Tensor], arch: ModelArch, *,
                   offset: int = 0) -> list[tuple[str, torch.Tensor]]:
    """HF (name, full tensor) pairs of one Megatron parameter given its TP shards in TP-rank order (a replicated
    parameter: any one shard). `offset` is the stage's first global layer. The tied output layer maps to nothing:
    the embedding stands for it. A vision-language model's come under transformers' in-memory names (its tower's
    parameters are whole on every rank)."""
    if arch.vision_model_type:
        if name.startswith(vision_language.TOWER):
            return [(vision_language.in_memory_name(name), shards[0])]
        return [(vision_language.in_memory_name(hf_name), tensor)
                for hf_name, tensor in _language_model_to_hf(name, shards, arch, offset=offset)]
    return _language_model_to_hf(name, shards, arch, offset=offset)


def _language_model_to_hf(name: str, shards: Sequence[torch.Tensor], arch: ModelArch, *,
                          offset: int = 0) -> list[tuple[str, torch.Tensor]]:
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", torch.cat(list(shards))[:arch.vocab_size])]
    if name == "output_layer.weight":
        return [] if arch.tie_word_embeddings else [("lm_head.weight", torch.cat(list(shards))[:arch.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    if name.startswith("mtp.layers."):
        return _mtp_to_hf(name, shards, arch)
    if not name.startswith("decoder.layers."):
        raise ValueError(f"no HF name for Megatron parameter {name!r}")
    index, sub = name.removeprefix("decoder.layers.").split(".", 1)
    return _layer_to_hf(name, _local_sub(sub), shards, arch, HF_LAYER.format(offset + int(index)))


def _mtp_to_hf(name: str, shards: Sequence[torch.Tensor], arch: ModelArch) -> list[tuple[str, torch.Tensor]]:
    """An MTP layer's parameter under its family's HF names (`models/mtp.py`)."""
    index, sub = name.removeprefix("mtp.layers.").split(".", 1)
    prefix = mtp.hf_prefix(arch.model_type, arch.num_layers, int(index))
    if sub.startswith("transformer_layer."):
        return _layer_to_hf(name, _local_sub(sub.removeprefix("transformer_layer.")), shards, arch, prefix)
    if sub not in (names := mtp.hf_names(arch.model_type)):
        raise ValueError(f"no HF name for Megatron parameter {name!r}")
    prefix = mtp.own_prefix(arch.model_type, arch.num_layers, int(index))
    if sub != "eh_proj.weight":
        return [(prefix + names[sub], shards[0])]
    tensor = torch.cat(list(shards))
    if mtp.swaps_projection_halves(arch.model_type):
        embedding, hidden = tensor.chunk(2, dim=1)
        tensor = torch.cat([hidden, embedding], dim=1)
    return [(prefix + names[sub], tensor)]


def _layer_to_hf(name: str, sub: str, shards: Sequence[torch.Tensor], arch: ModelArch,
                 prefix: str) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of a decoder layer's parameter `sub` (local-spec name), the layer's HF prefix given."""
    if arch.mla is not None and (mla := deepseek_v3.megatron_to_hf_attention(deepseek_v3.local_sub(sub), list(shards),
                                                                             prefix)) is not None:
        return mla
    if arch.dsa is not None and (indexer := glm_moe_dsa.megatron_to_hf_indexer(sub, list(shards), arch,
                                                                             prefix)) is not None:
        return indexer
    if arch.post_norms and (pairs := glm4.megatron_to_hf_layer(sub, list(shards), prefix)) is not None:
        return pairs
    if arch.linear_attention is not None and sub not in RENAMED and \
            (pairs := qwen3_next.megatron_to_hf_linear_attention(sub, list(shards), arch, prefix)) is not None:
        return pairs
    if sub in qwen3_next.SHARED_EXPERT_GATE:
        return [(prefix + qwen3_next.SHARED_EXPERT_GATE[sub], shards[0])]
    if sub in QK_NORMS and arch.projection_qk_norm:  # cut over TP as the heads are
        return [(prefix + RENAMED[sub], torch.cat(list(shards)))]
    if sub in RENAMED:
        tensor = torch.cat(list(shards), dim=1) if sub in ROW_PARALLEL else shards[0]
        return [(prefix + RENAMED[sub], tensor)]
    if sub in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = sub.rsplit(".", 1)[1]
        q, k, v = _split_qkv(arch, torch.cat(list(shards)))
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in (("q", q), ("k", k), ("v", v))]
    if sub == "mlp.router.weight":
        return [(prefix + "mlp.gate.weight", shards[0])]
    if sub == EXPERT_BIAS:
        return [(prefix + _hf_expert_bias(arch), shards[0])]
    if sub == "mlp.shared_experts.linear_fc2.weight":
        return [(prefix + _hf_shared_experts(arch) + "down_proj.weight", torch.cat(list(shards), dim=1))]
    if sub.startswith(LOCAL_EXPERT):  # one expert: fused with the others of its layer by `fuse_experts`
        index, kind = sub.removeprefix(LOCAL_EXPERT).split(".", 1)
        return [(f"{prefix}mlp.experts.{index}.{kind}", shards[0])]
    if sub in FC1:
        gates, ups = zip(*(s.chunk(2) for s in shards), strict=True)
        mlp = prefix + ("mlp." if sub == FC1[0] else _hf_shared_experts(arch))
        return [(mlp + "gate_proj.weight", torch.cat(gates)), (mlp + "up_proj.weight", torch.cat(ups))]
    raise ValueError(f"no HF name for Megatron parameter {name!r}")


def fuse_experts(named: Iterator[tuple[str, torch.Tensor]], arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert (name, tensor) pairs of `megatron_to_hf` (`...mlp.experts.{e}.linear_fc1.weight`) held until a
    layer's experts are all there, then yielded under transformers' fused names; every other pair passes through."""
    held: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in named:
        layer, sep, rest = name.partition("mlp.experts.")
        if not sep or not rest.split(".", 1)[0].isdigit():
            yield name, tensor
            continue
        index, kind = rest.split(".", 1)
        experts = held.setdefault((layer, kind), {})
        experts[int(index)] = tensor
        if len(experts) == arch.num_experts:
            stacked = torch.stack([experts[e] for e in range(arch.num_experts)])
            del held[(layer, kind)]
            yield layer + ("mlp.experts.gate_up_proj" if kind == "linear_fc1.weight" else "mlp.experts.down_proj"), \
                stacked


def _whole_expert(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """One expert's parameter from its expert-TP shards: linear_fc1 cat(gate, up) of the gathered chunks, linear_fc2
    its dim-1 chunks side by side."""
    if name.endswith("linear_fc2.weight"):
        return torch.cat(list(shards), dim=1)
    gates, ups = zip(*(shard.chunk(2) for shard in shards), strict=True)
    return torch.cat([*gates, *ups])


def _gather_experts(tensor: torch.Tensor, ep_size: int, ep_group) -> list[torch.Tensor]:
    """One local expert's parameter from every expert-parallel rank, in EP-rank order."""
    import torch.distributed as dist

    gathered = [torch.empty_like(tensor) for _ in range(ep_size)]
    dist.all_gather(gathered, tensor.contiguous(), group=ep_group)
    return gathered


def _whole_local_expert(name: str, tensor: torch.Tensor, etp_size: int, etp_group) -> torch.Tensor:
    """This rank's local expert parameter made whole over its expert-TP group (as it is at expert TP 1)."""
    import torch.distributed as dist

    if etp_size == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(etp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=etp_group)
    return _whole_expert(name, shards)


def gather_hf_weights(named_params: Sequence[tuple[str, torch.Tensor]], arch: ModelArch, *, tp_group, tp_rank: int,
                      tp_size: int, pp_group, pp_rank: int, pp_size: int, dp_rank: int, ep_group=None,
                      ep_size: int = 1, expert_dp_rank: int = 0,
                      etp_size: int = 1, etp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective over all ranks: the source rank (global rank 0: pp, tp and dp rank 0) yields every HF weight
    once, stage by stage; every other rank yields nothing. Each stage's data-parallel rank 0 all-gathers its
    parameters over TP, its TP rank 0 converts them and sends them to the source rank. Experts are first
    all-gathered over the expert-parallel group, whose other ranks are other data-parallel ranks: those join the
    gathers and yield nothing. Under expert tensor parallelism (etp_size = tp_size: `ModelArch.check_parallel`) each
    expert is gathered over its expert-TP group (the TP ranks) and put together as a dense MLP is, before any gather
    over expert parallelism."""
    import torch.distributed as dist

    if dp_rank != 0:
        if ep_size > 1 and expert_dp_rank == 0:
            for name, param in named_params:
                if LOCAL_EXPERT in name:
                    _gather_experts(_whole_local_expert(name, param.detach(), etp_size, etp_group), ep_size, ep_group)
        return
    local_experts = arch.num_experts // ep_size
    offset = layer_offset(arch, pp_rank=pp_rank, pp_size=pp_size)
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else [dist.get_rank()]
    source = pp_ranks[0]

    def converted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in named_params:
            if (name == "output_layer.weight" and arch.tie_word_embeddings) or \
                    (name == "embedding.word_embeddings.weight" and pp_rank > 0):
                continue  # the last stage's copy of the embedding (its output weight or its MTP layers')
            tensor = param.detach()
            if LOCAL_EXPERT in name and ep_size > 1:  # expert i of EP rank j is global expert j·local + i
                head, tail = name.split(LOCAL_EXPERT)
                index, rest = tail.split(".", 1)
                whole = _whole_local_expert(name, tensor, etp_size, etp_group)  # whole over expert TP first
                for j, expert in enumerate(_gather_experts(whole, ep_size, ep_group)):
                    global_name = f"{head}{LOCAL_EXPERT}{j * local_experts + int(index)}.{rest}"
                    if tp_rank == 0:
                        yield from megatron_to_hf(global_name, [expert], arch, offset=offset)
                continue
            if LOCAL_EXPERT in name and etp_size > 1:
                shards = [torch.empty_like(tensor) for _ in range(etp_size)]
                dist.all_gather(shards, tensor.contiguous(), group=etp_group)
                if tp_rank == 0:
                    yield from megatron_to_hf(name, [_whole_expert(name, shards)], arch, offset=offset)
                continue
            shards = [tensor]
            # experts are whole on every TP rank (expert TP 1), though megatron-core marks them tensor-parallel
            if tp_size > 1 and getattr(param, "tensor_model_parallel", False) and LOCAL_EXPERT not in name:
                shards = [torch.empty_like(tensor) for _ in range(tp_size)]
                dist.all_gather(shards, tensor.contiguous(), group=tp_group)
            if tp_rank == 0:
                yield from megatron_to_hf(name, shards, arch, offset=offset)

    if pp_rank == 0:
        yield from fuse_experts(converted(), arch)
    elif tp_rank == 0:
        for hf_name, tensor in fuse_experts(converted(), arch):
            dist.send_object_list([(hf_name, tuple(tensor.shape), tensor.dtype)], dst=source, device=tensor.device)
            dist.send(tensor.contiguous(), dst=source)
        dist.send_object_list([None], dst=source, device=named_params[0][1].device)
    else:
        for _ in converted():
            pass
    if pp_rank == 0 and tp_rank == 0:
        device = named_params[0][1].device
        for stage in range(1, pp_size):
            while True:
                meta = [None]
                dist.recv_object_list(meta, src=pp_ranks[stage], device=device)
                if meta[0] is None:
                    break
                hf_name, shape, dtype = meta[0]
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(tensor, src=pp_ranks[stage])
                yield hf_name, tensor
