"""The mixture-of-experts load-balancing loss (Megatron's `aux_loss` load-balancing type, Switch Transformer's
loss as megatron-core's `switch_load_balancing_loss_func` computes it), summed over the MoE layers.

Fedus et al., "Switch Transformers": https://arxiv.org/abs/2101.03961
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LOAD_BALANCING_TYPES = ("aux_loss", "none")


def load_balancing_loss(router_logits: Sequence[torch.Tensor], *, top_k: int,
                        experts: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Σ over layers of E / (k · T²) · Σ_e P_e · c_e, a float32 scalar.

    router_logits: one [T, E] per MoE layer over the same T tokens. P_e = Σ_t softmax(logits_t)_e (the router's
    probability mass on expert e); c_e = the tokens routed to e, each token counted at its k experts: the router's
    own top-k, or `experts` (one [T, k] per layer) where the routing was replayed. A perfectly even routing gives
    1 per layer (P_e = T / E, c_e = k · T / E).
    """
    total = torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    for i, logits in enumerate(router_logits):
        probs = torch.softmax(logits.float(), dim=-1)
        num_tokens, num_experts = probs.shape
        chosen = experts[i].to(probs.device, torch.long) if experts is not None else probs.topk(top_k, dim=-1).indices
        counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
        counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
        total = total + num_experts / (top_k * num_tokens ** 2) * (probs.sum(dim=0) * counts).sum()
    return total
