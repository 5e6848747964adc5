"""The last decoder layer's MLP on the positions the loss reads, for both backends. Under the fused head only the
positions that predict a response token reach the LM head, so the last layer's dense MLP (most of that layer's work)
need not run on the prompt's and the padding's positions: they keep the attention block's output, which nothing
reads after them. Every other position's hidden state is computed as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def is_dense_mlp(mlp: torch.nn.Module | None) -> bool:
    """A position-wise MLP: megatron-core's MLP, or an HF gated MLP (gate/up/down projections, no experts). A MoE
    block is not one: its routing (replay, load balancing) sees every token."""
    if mlp is None:
        return False
    if type(mlp).__name__ == "MLP" and type(mlp).__module__.startswith("megatron.core.transformer.mlp"):
        return True
    return all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")) and \
        not any(hasattr(mlp, name) for name in ("experts", "gate", "router"))


@contextlib.contextmanager
def mlp_on_rows(mlp: torch.nn.Module | None, positions: torch.Tensor | None, *,
                sequence_first: bool) -> Iterator[None]:
    """Within it, `mlp`'s forward runs on the rows `positions` marks and returns zeros on the others. positions:
    [b, L] padded or [1, T] packed bool (`packing.response_mask`); the MLP's input is [L, b, H] or [T, 1, H]
    (sequence_first: megatron-core's layout) or [b, L, H] / [1, T, H] (transformers'); an input of another size
    runs whole. None for either: the MLP as it is."""
    if mlp is None or positions is None:
        yield
        return
    order = positions.t() if sequence_first else positions
    index = order.reshape(-1).nonzero().squeeze(1)
    whole = mlp.forward

    def forward(hidden: torch.Tensor, *args, **kwargs):
        if hidden.shape[:2] != order.shape:
            return whole(hidden, *args, **kwargs)
        flat = hidden.reshape(-1, hidden.shape[-1])
        rows = flat.index_select(0, index.to(flat.device))
        out = whole(rows.unsqueeze(1) if sequence_first else rows.unsqueeze(0), *args, **kwargs)
        result, extra = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        full = result.new_zeros(flat.shape[0], result.shape[-1]).index_copy(
            0, index.to(result.device), result.reshape(-1, result.shape[-1]))
        full = full.view(*hidden.shape[:-1], result.shape[-1])
        return full if extra is None else (full, *extra)

    mlp.forward = forward  # an instance attribute: the module's hooks still run around it
    try:
        yield
    finally:
        del mlp.forward
