"""An HF causal LM's forward that stops before its LM head: the model returns the final hidden states of the
positions `logits_to_keep` selects, and the log-probs come from them and the head's weight by the fused, chunked
computation (`algorithms.fused_log_probs`), without the [tokens × vocab] logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.trainer.algorithms.fused_log_probs import fused_log_probs_and_entropy
from services.trainer.batching.batch import RolloutBatch
from services.trainer.batching.packing import response_valid, scatter_response

# Families whose causal LM's logits are `lm_head(hidden_states)` and nothing more (no soft-capping, no scale):
# for them the head's input and weight give the logits exactly.
PLAIN_HEAD_FAMILIES = ("llama", "mistral", "olmo2", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_5",
                       "qwen3_5_moe", "glm4_moe", "deepseek_v3")


def fusable(model: torch.nn.Module) -> bool:
    """Whether `model`'s logits are its output embedding's bias-free projection of the forward's hidden states."""
    head = model.get_output_embeddings()
    text = model.config.get_text_config()
    return (str(getattr(model.config, "model_type", "")).removesuffix("_text") in PLAIN_HEAD_FAMILIES
            and isinstance(head, torch.nn.Linear) and head.bias is None
            and getattr(text, "final_logit_softcapping", None) is None)


@dataclass
class Head:
    """The LM head's weight as the forward used it (under FSDP2: the gathered, compute-dtype parameter)."""
    weight: torch.Tensor | None = None
    compute_dtype: torch.dtype | None = None  # autocast's during the forward, when it was on


@contextlib.contextmanager
def hidden_states_out(model: torch.nn.Module, enabled: bool = True) -> Iterator[Head | None]:
    """Within it, `model`'s forward returns as its `logits` the hidden states its head would project; the yielded
    Head holds the weight that head had during the forward. enabled False: the model as it is, and None."""
    if not enabled:
        yield None
        return
    head_module, head = model.get_output_embeddings(), Head()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        head.weight = head_module.weight
        device = hidden.device.type
        head.compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return hidden

    head_module.forward = forward  # an instance attribute: the module's hooks (FSDP's) still run around it
    try:
        yield head
    finally:
        del head_module.forward


def response_row_stats(hidden_rows: torch.Tensor, head: Head, mb: RolloutBatch, *, temperature: float,
                       chunk_size: int, with_entropy: bool = True,
                       entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The response tokens' hidden states [N, H] (in `packing.response_mask`'s order) -> response-aligned
    (log_probs, entropy) [b, R] at `temperature`, zero on padding columns."""
    if head.weight is None:
        raise RuntimeError("the model's forward did not call its LM head")
    hidden_rows = hidden_rows.reshape(-1, hidden_rows.shape[-1])
    targets = mb.response_tokens[response_valid(mb)].to(hidden_rows.device)
    log_probs, entropy = fused_log_probs_and_entropy(hidden_rows, head.weight, targets, temperature=temperature,
                                                     with_entropy=with_entropy, entropy_grad=entropy_grad,
                                                     chunk_size=chunk_size, compute_dtype=head.compute_dtype)
    return scatter_response(log_probs, mb), None if entropy is None else scatter_response(entropy, mb)
