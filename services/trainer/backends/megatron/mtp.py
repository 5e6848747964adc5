"""Multi-token prediction on megatron-core's MTP block: which forwards run it, its outputs cut from the policy's, and
which response token each depth's position predicts.

megatron-core's MTP layer k (1-based) combines the hidden state at position t with the embedding of token t + k and
predicts token t + k + 1, through the shared output layer. GPTModel here is built without config.mtp_num_layers, so
its forward returns every depth's outputs ([b, (1 + N)·s, ...]) rather than computing a loss of its own, and the
backend adds the MTP loss: per depth, the cross-entropy (temperature 1) of the trained response tokens, averaged over
the step's tokens, the sum over depths times mtp_loss_scaling_factor / N (megatron-core's scaling).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from services.trainer.batching import packing
from services.trainer.batching.batch import RolloutBatch


@contextlib.contextmanager
def running(gpt, enabled: bool) -> Iterator[None]:
    """Within it, `gpt`'s forward runs its MTP layers (when it has them and `enabled`)."""
    if not enabled or not hasattr(gpt, "mtp"):
        yield
        return
    gpt.mtp_process = True
    try:
        yield
    finally:
        gpt.mtp_process = False


def split_depths(output: torch.Tensor, num_layers: int, *, sequence_parallel_size: int = 1) -> list[torch.Tensor]:
    """The model's outputs [b, (1 + N)·s, ...] -> 1 + N tensors [b, s, ...]: the decoder's, then each MTP depth's.
    Under sequence parallelism the output layer gathered every TP rank's slice of all depths at once ([tp, 1 + N,
    s/tp] order), which is put back into depth order."""
    b, total = output.shape[:2]
    depths, tp = 1 + num_layers, sequence_parallel_size
    parts = output.view(b, tp, depths, total // (tp * depths), *output.shape[2:]).transpose(1, 2)
    return list(parts.reshape(b, depths, total // depths, *output.shape[2:]).unbind(1))


def _reaches(mb: RolloutBatch, depth: int) -> torch.Tensor:
    """[b, R] bool: the response tokens that an MTP position of `depth` predicts (the position lies in the sequence)."""
    return mb.logit_positions() - depth >= 0


def target_weights(mb: RolloutBatch, depth: int) -> torch.Tensor:
    """[b, R]: each response token's weight in depth `depth`'s loss: its loss mask, where that depth predicts it."""
    reach = _reaches(mb, depth) & packing.response_valid(mb)
    return mb.loss_masks * reach.to(mb.loss_masks.dtype)


def gather_depth(x: torch.Tensor, mb: RolloutBatch, depth: int) -> torch.Tensor:
    """Depth `depth`'s per-position outputs, padded [b, L, ...] or packed [1, T, ...] -> [b, R, ...]: for each
    response token, the output of the position `depth` before the one the decoder predicts it from (the sequence's
    own position where there is none: `target_weights` gives it no weight)."""
    index = packing.response_index(mb, packed=packing.is_packed(x, mb))
    index = torch.where(_reaches(mb, depth), index - depth, index).to(x.device)
    return x.flatten(0, 1).index_select(0, index.flatten()).view(*index.shape, *x.shape[2:])
