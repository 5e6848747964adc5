"""slime.backends.megatron_utils.cp_utils: a sample's response sliced to this context-parallel rank's part and
gathered back over the group, in slime's layout (`services/trainer/distributed/cp_responses.py`). Under the megatron
backend at context_parallel_size > 1 a custom TIS function gets each sample's CP slice, as in slime; elsewhere the
CP size is 1 and both are the identity."""

from __future__ import annotations

from typing import Any

from services.trainer.distributed import cp_responses


def get_logits_and_tokens_offset_with_cp(total_length: int, response_length: int):
    """slime's offsets on this rank: (chunk size, the two chunks, the two logit ranges, the two token ranges), each
    range [start, end) in sequence positions (an empty one (0, 0))."""
    cp = cp_responses.current()
    chunk = (total_length + 2 * cp.size - 1) // (2 * cp.size)
    chunks = tuple((i * chunk, (i + 1) * chunk) for i in (cp.rank, 2 * cp.size - cp.rank - 1))
    logits = cp_responses.logit_ranges(total_length, response_length, cp)
    tokens = tuple((start + 1, end + 1) if start < end else (0, 0) for start, end in logits)
    return chunk, chunks, logits, tokens


def all_gather_with_cp(tensor: Any, total_length: int, response_length: int) -> Any:
    """This rank's part of a sample's response tensor -> the whole response, on every rank of the CP group."""
    return cp_responses.gather_response(tensor, total_length, response_length, cp_responses.current())


def slice_log_prob_with_cp(log_prob: Any, total_length: int, response_length: int) -> Any:
    """A sample's whole response values (a tensor or a list) -> this context-parallel rank's part."""
    return cp_responses.slice_response(log_prob, total_length, response_length, cp_responses.current())
