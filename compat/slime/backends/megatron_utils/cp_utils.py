"""slime.backends.megatron_utils.cp_utils at context-parallel size 1, which is what a custom TIS function sees in
Physarum's trainer: every rank holds each sample's whole response (under context parallelism too: the per-token
outputs are gathered before the loss), so gathering and slicing are the identity."""

from __future__ import annotations

from typing import Any


def all_gather_with_cp(tensor: Any, total_length: int, response_length: int) -> Any:
    """A sample's response tensor gathered over the context-parallel ranks: at CP 1, the tensor itself."""
    return tensor


def slice_log_prob_with_cp(values: Any, total_length: int, response_length: int) -> Any:
    """This context-parallel rank's slice of a sample's response tensor: at CP 1, all of it."""
    return values
