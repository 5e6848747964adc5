"""The mixture-of-experts load-balancing losses (Megatron's `aux_loss`, `seq_aux_loss` and `global_aux_loss` types,
Switch Transformer's loss as megatron-core's `switch_load_balancing_loss_func` computes it, on the scores its
`compute_routing_scores_for_aux_loss` gives softmax and sigmoid routers), summed over the MoE layers.

Fedus et al., "Switch Transformers": https://arxiv.org/abs/2101.03961
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
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
        scores, routed = _scores_and_routed(logits, top_k, score_function)
        total = total + _switch_loss(scores.sum(dim=0), routed.sum(dim=0), scores.shape[0], top_k)
    return total


def sequence_load_balancing_loss(router_logits: Sequence[torch.Tensor], valid: torch.Tensor, *, top_k: int,
                                 score_function: ScoreFunction = "softmax") -> torch.Tensor:
    """Megatron's seq_aux_loss of one micro-batch of B rows (a packed row is one): Σ over layers of
    1/B · Σ_rows E / (k · T̄²) · Σ_e P_re · c_re, a float32 scalar.

    router_logits: one [B, L, E] per MoE layer; valid [B, L]: the real tokens (pad tokens neither weigh nor count).
    P_re and c_re are `load_balancing_loss`'s within row r; T̄ is the micro-batch's real tokens per row (megatron-core
    divides every row's sum by the same mean count, not by the row's own).
    """
    valid = valid.bool()
    rows = valid.shape[0]
    mean_tokens = valid.sum().item() / rows
    total = torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        scores, routed = _scores_and_routed(logits.reshape(-1, logits.shape[-1]), top_k, score_function)
        keep = valid.reshape(-1, 1).to(scores.device)
        scores, routed = (scores * keep).reshape(logits.shape), (routed * keep).reshape(logits.shape)
        total = total + _switch_loss(scores.sum(dim=1), routed.sum(dim=1), mean_tokens, top_k) / rows
    return total


def global_load_balancing_loss(router_logits: Sequence[Sequence[torch.Tensor]], *, top_k: int,
                               score_function: ScoreFunction = "softmax") -> list[torch.Tensor]:
    """Megatron's global_aux_loss of a step's micro-batches in the order they run (on one data-parallel rank, or each
    micro-batch the union of every rank's): per micro-batch m, Σ over layers of E / (k · T_m²) · Σ_e P_me · c̄_me,
    c̄_me the mean over micro-batches 1..m of the experts' token counts (megatron-core's running average).

    router_logits: per micro-batch, one [T_m, E] per MoE layer over its real tokens.
    """
    losses, counts = [], None
    for m, layers in enumerate(router_logits, start=1):
        routed_layers = [_scores_and_routed(logits, top_k, score_function) for logits in layers]
        step_counts = torch.stack([routed.sum(dim=0) for _, routed in routed_layers])
        counts = step_counts if counts is None else counts + step_counts
        losses.append(sum(_switch_loss(scores.sum(dim=0), counts[i] / m, scores.shape[0], top_k)
                          for i, (scores, _) in enumerate(routed_layers)))
    return losses


def _scores_and_routed(logits: torch.Tensor, top_k: int,
                       score_function: ScoreFunction) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] scores (`router_scores`) and [T, E] 1.0 where the scores' top k choose an expert."""
    scores = router_scores(logits, score_function)
    routed = torch.zeros_like(scores).scatter_(1, scores.topk(top_k, dim=-1).indices, 1.0)
    return scores, routed


def _switch_loss(probability_mass: torch.Tensor, counts: torch.Tensor, num_tokens: float, top_k: int) -> torch.Tensor:
    """E / (k · T²) · Σ_e P_e · c_e over the last dimension (E experts), summed over any before it."""
    return probability_mass.shape[-1] / (top_k * num_tokens ** 2) * (probability_mass * counts).sum()
