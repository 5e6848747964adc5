"""Token log-probs and entropy from vocab-parallel logits: each TP rank holds a slice of the vocabulary.

The log-sum-exp, the target logit and the entropy numerator are all-reduced over the TP group (forward: sum,
backward: identity, as Megatron's `reduce_from_tensor_model_parallel_region`), so every rank gets the full
values and the gradient of its own logits. Padded vocab rows (index >= vocab_size) are left out of the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce SUM over `group`; backward: identity (every rank computes the same loss from it)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def vocab_parallel_log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                                         temperature: float = 1.0, tp_rank: int = 0, tp_size: int = 1,
                                         group=None, with_entropy: bool = True,
                                         entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target) and the entropy of π = softmax(logits / temperature) over the first vocab_size entries.

    logits: [..., V/tp], this rank's contiguous slice [tp_rank·V/tp, (tp_rank+1)·V/tp) of the padded vocab;
    targets: [...] int64 global token ids. Returns (log_probs, entropy), each [...] float32, identical on every
    rank of the group. With tp_size 1 this equals `algorithms.losses.token_log_probs_and_entropy`.
    """
    if tp_size == 1:  # the whole vocabulary here: the fused log-softmax path
        from services.trainer.algorithms.losses import token_log_probs_and_entropy

        return token_log_probs_and_entropy(logits[..., :vocab_size], targets, temperature=temperature,
                                           with_entropy=with_entropy, entropy_grad=entropy_grad)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    part = logits.shape[-1]
    start = tp_rank * part
    valid = max(0, min(part, vocab_size - start))
    logits = logits[..., :valid]  # a view even when empty, so every rank's backward reaches its output layer

    def reduce_sum(x: torch.Tensor) -> torch.Tensor:
        return _SumOverGroup.apply(x, group) if tp_size > 1 else x

    with torch.no_grad():
        local_max = (logits.amax(dim=-1) if valid else
                     torch.full(logits.shape[:-1], float("-inf"), device=logits.device))
        if tp_size > 1:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_sum(exp.sum(dim=-1))
    local_targets = targets.long() - start
    in_range = (local_targets >= 0) & (local_targets < valid)
    if valid:
        picked = shifted.gather(-1, local_targets.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1)
        picked = picked * in_range
    else:
        picked = shifted.sum(dim=-1)  # zeros, still connected to the graph
    log_z = sum_exp.log()
    log_probs = reduce_sum(picked) - log_z
    entropy = log_z - reduce_sum((exp * shifted).sum(dim=-1)) / sum_exp
    return log_probs, entropy
