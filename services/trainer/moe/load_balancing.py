"""The mixture-of-experts load-balancing loss (Megatron's `aux_loss` load-balancing type, Switch Transformer's
loss as megatron-core's `switch_load_balancing_loss_func` computes it, on the scores its
`compute_routing_scores_for_aux_loss` gives softmax and sigmoid routers), summed over the MoE layers.

Fedus et al., "Switch Transformers": https://arxiv.org/abs/2101.03961
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

LOAD_BALANCING_TYPES = ("aux_loss", "none")
ScoreFunction = Literal["softmax", "sigmoid"]
SIGMOID_EPS = 1e-20  # megatron-core's, in the sigmoid scores' normalization


def router_scores(logits: torch.Tensor, score_function: ScoreFunction) -> torch.Tensor:
    """[T, E] float32 scores the loss weighs, from router logits [T, E]: softmax; or sigmoid normalized over all E
    experts (DeepSeek-V3's and GLM-4-MoE's routers; their expert bias and group limit choose experts, they are not
    in the scores)."""
    if score_function == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        return scores / (scores.sum(dim=-1, keepdim=True) + SIGMOID_EPS)
    raise ValueError(f"score_function {score_function!r}: expected softmax or sigmoid")


def load_balancing_loss(router_logits: Sequence[torch.Tensor], *, top_k: int,
                        score_function: ScoreFunction = "softmax") -> torch.Tensor:
    """Σ over layers of E / (k · T²) · Σ_e P_e · c_e, a float32 scalar.

    router_logits: one [T, E] per MoE layer over the same T tokens. P_e = Σ_t score_te (`router_scores`: the router's
    probability mass on expert e); c_e = the tokens whose k top scores include e, as megatron-core counts them: for
    a sigmoid router its expert bias and group limit do not count, and under routing replay neither do the replayed
    experts. A perfectly even routing gives 1 per layer (P_e = T / E, c_e = k · T / E).
    """
    total = torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        scores = router_scores(logits, score_function)
        num_tokens, num_experts = scores.shape
        chosen = scores.topk(top_k, dim=-1).indices
        counts = torch.zeros(num_experts, dtype=torch.float32, device=scores.device)
        counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=scores.device))
        total = total + num_experts / (top_k * num_tokens ** 2) * (scores.sum(dim=0) * counts).sum()
    return total
