"""The local spec's block of a hybrid stack (Qwen3-Next, Qwen3.5): each layer a gated delta-net (`gated_delta_net.py`)
or attention with an output gate, as the model's linear_layers say, a dense MLP or MoE as its moe_layers say, every
RMSNorm zero-centered but the gated delta-net's own. megatron-core's hybrid block spec builds on Transformer Engine
only; this one is built of megatron-core's local modules and runs on either device.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention

from services.trainer.models.arch import ModelArch


class GatedSelfAttention(SelfAttention):
    """megatron-core's attention with its output gate applied eagerly (its torch.compile'd one needs a compiler on
    the CPU)."""

    def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)


def layer_spec(arch: ModelArch, *, linear: bool, moe: bool, core_attention: type):
    """One layer's ModuleSpec: a gated delta-net or gated attention (with `core_attention`), a dense MLP or MoE."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from services.trainer.backends.megatron.gated_delta_net import GatedDeltaNet, GatedNorm
    from services.trainer.backends.megatron.norm import ZeroCenteredRMSNorm

    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts if moe else None, qk_layernorm=True,
                                    normalization="RMSNorm")
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = ZeroCenteredRMSNorm
    if linear:
        layer.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedNorm, out_proj=RowParallelLinear))
    else:
        attention = layer.self_attention  # a fresh spec of each call
        attention.module = GatedSelfAttention
        attention.submodules.core_attention = core_attention
        attention.submodules.q_layernorm = attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    return spec


def hybrid_block(arch: ModelArch, config, *, core_attention: type):
    """This pipeline stage's TransformerBlockSubmodules."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from services.trainer.backends.megatron.norm import ZeroCenteredRMSNorm

    specs: dict[tuple[bool, bool], object] = {}
    stage = arch.stage_layer_range(parallel_state.get_pipeline_model_parallel_rank(),
                                   config.pipeline_model_parallel_size)
    layers = []
    for index in stage:
        kind = (arch.is_linear_layer(index), arch.is_moe_layer(index))
        if kind not in specs:
            specs[kind] = layer_spec(arch, linear=kind[0], moe=kind[1], core_attention=core_attention)
        layers.append(specs[kind])
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)
