"""The MiniMax-M2 family (`minimax_m2`) on megatron-core: grouped-query attention whose q and k RMSNorms span the
whole projection (every head at once, `backends/megatron/projection_norm.py`), RoPE on the first
partial_rotary_factor of each head, and every layer a MoE one with a sigmoid router whose expert bias sits on the
MoE block (mlp.e_score_correction_bias), its top-k weights renormalized, no shared expert. Its ModelArch fields and
the weight names that differ from convert.py's: the q/k norms cut over TP as the heads are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from services.common.errors import InvalidArgument
from services.trainer.models.gqa import gqa_fields

HF_EXPERT_BIAS = "mlp.e_score_correction_bias"


def arch_fields(get: Callable[..., Any]) -> dict[str, Any]:
    """ModelArch's fields of a minimax_m2 config (`get(key, default)`); what megatron-core cannot build raises
    InvalidArgument naming the field."""
    def refuse(problem: str) -> InvalidArgument:
        return InvalidArgument(f"megatron backend: minimax_m2 {problem}")

    fields = gqa_fields(get, "minimax_m2")
    if get("use_qk_norm", True) is False or get("qk_norm_type", "per_layer") != "per_layer":
        raise refuse("q/k norms other than one RMSNorm over the whole projection are not supported")
    experts = get("num_local_experts") or 0
    return dict(
        fields,
        # not megatron-core's qk_layernorm: it would sum the norms' gradients over TP, which cut them as the heads
        qkv_bias=False, qk_layernorm=False, projection_qk_norm=True, num_experts=experts,
        moe_router_topk=get("num_experts_per_tok") or 0, moe_ffn_hidden_size=get("intermediate_size"),
        moe_router_score_function="sigmoid", moe_router_expert_bias=True)

# transformers' in-memory names (the engines', the export's) -> the checkpoint files' (Mixtral's layout)
_DISK_NAMES = (("mlp.gate.", "block_sparse_moe.gate."),
               ("mlp.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"),
               ("mlp.experts.", "block_sparse_moe.experts."), ("gate_proj.", "w1."), ("up_proj.", "w3."),
               ("down_proj.", "w2."))


class CheckpointNames(Mapping):
    """An HF checkpoint's tensors under transformers' in-memory names, whether its files hold those or the released
    checkpoints' (block_sparse_moe.*, experts' w1/w3/w2)."""

    def __init__(self, tensors: Mapping) -> None:
        self.tensors = tensors

    def _disk(self, name: str) -> str:
        for memory, disk in _DISK_NAMES:
            name = name.replace(memory, disk)
        return name

    def __getitem__(self, name: str):
        return self.tensors[name] if name in self.tensors else self.tensors[self._disk(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.tensors or self._disk(name) in self.tensors)

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
