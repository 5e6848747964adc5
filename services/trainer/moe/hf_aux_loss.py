"""The load-balancing loss of an HF MoE model's training forward (moe_aux_loss_coeff): its router logits over the
micro-batch's real tokens, the loss added to the policy loss, Megatron's aux_loss or seq_aux_loss (a packed row is
one sequence, a padded micro-batch one per row, as megatron-core's rows). The formulas are load_balancing.py's
(megatron-core's: under routing replay too it counts the experts the router's own scores pick)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument
from services.trainer.batching.batch import RolloutBatch
from services.trainer.models import families
from services.trainer.moe.load_balancing import ScoreFunction, load_balancing_loss, sequence_load_balancing_loss


@dataclass(frozen=True)
class RouterKind:
    top_k: int  # experts per token
    score_function: ScoreFunction  # the scores the loss weighs: softmax (Qwen) or sigmoid (GLM-4-MoE, DeepSeek-V3)


def router_kind(model: torch.nn.Module) -> RouterKind:
    """The routers of a model that outputs its router logits (transformers' output_router_logits), or
    InvalidArgument."""
    config = model.config.get_text_config()
    if not hasattr(config, "output_router_logits"):
        raise InvalidArgument(f"moe_aux_loss_coeff: {type(model).__name__} outputs no router logits "
                              "(output_router_logits) to compute a load-balancing loss from")
    sigmoid = families.family({"model_type": model.config.model_type}) in families.SIGMOID_ROUTERS
    return RouterKind(int(config.num_experts_per_tok), "sigmoid" if sigmoid else "softmax")


def add_load_balancing_loss(loss: torch.Tensor, metrics: dict[str, torch.Tensor],
                            router_logits: tuple[torch.Tensor, ...], mb: RolloutBatch, *, coeff: float,
                            router: RouterKind, packed: bool, num_micro_batches: int,
                            kind: str = "aux_loss") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss + coeff · aux / num_micro_batches (Megatron scales each micro-batch's aux loss so that a step's is their
    mean); `moe_aux_loss` in the metrics, which sum over a step's micro-batches, likewise. kind: aux_loss or
    seq_aux_loss."""
    if kind == "seq_aux_loss":
        rows = 1 if packed else mb.attention_mask.shape[0]
        logits = [layer.reshape(rows, -1, layer.shape[-1]) for layer in router_logits]
        valid = torch.ones(logits[0].shape[:2], dtype=torch.bool) if packed else mb.attention_mask.bool()
        aux = sequence_load_balancing_loss(logits, valid, top_k=router.top_k, score_function=router.score_function)
    else:
        real = None if packed else mb.attention_mask.bool().flatten()  # padding rows route too: not counted
        logits = [layer if real is None else layer[real.to(layer.device)] for layer in router_logits]
        aux = load_balancing_loss(logits, top_k=router.top_k, score_function=router.score_function)
    aux = aux / num_micro_batches
    return loss + coeff * aux.to(loss.dtype), {**metrics, "moe_aux_loss": aux.detach()}
