"""Multi-token prediction on megatron-core's MTP block: which forwards run it, its outputs cut from the policy's, and
which response token each depth's position predicts.

megatron-core's MTP layer k (1-based) combines the hidden state at position t with the embedding of token t + k and
predicts token t + k + 1, through the shared output layer. GPTModel here is built without config.mtp_num_layers, so
its forward returns every depth's outputs ([b, (1 + N)·s, ...]) rather than computing a loss of its own, and the
backend adds the MTP loss: per depth, the cross-entropy (temperature 1) of the trained response tokens, averaged over
the step's tokens, the sum over depths times mtp_loss_scaling_factor / N (megatron-core's scaling).

Under pipeline parallelism megatron-core builds the MTP block on the last stage, with a copy of the word embeddings
there; without config.mtp_num_layers it neither marks that copy shared nor sums its gradient with the first stage's
when the embeddings are untied, which `share_embedding_copy` and `finalize_with_embedding_copy` do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from services.trainer.batching import packing
from services.trainer.batching.batch import RolloutBatch


def run_only_when_asked(gpt) -> None:
    """Make `gpt`'s MTP block (on its last stage) pass the decoder's hidden states through, unless within `running`.
    gpt.mtp_process stays True: megatron-core reads it as "this stage holds the MTP block and an embedding" (the
    output weight, the embedding group, the checkpoint's tied keys)."""
    block = gpt.mtp
    block.runs = False
    forward = block.forward

    def forward_when_running(*args, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        return forward(*args, hidden_states=hidden_states, **kwargs) if block.runs else hidden_states

    block.forward = forward_when_running


def runs(gpt) -> bool:
    """Whether `gpt`'s forward runs MTP layers now (its output holds 1 + N depths)."""
    return getattr(getattr(gpt, "mtp", None), "runs", False)


@contextlib.contextmanager
def running(gpt, enabled: bool) -> Iterator[None]:
    """Within it, `gpt`'s forward runs its MTP layers (when it has them and `enabled`)."""
    if not enabled or not hasattr(gpt, "mtp"):
        yield
        return
    gpt.mtp.runs = True
    try:
        yield
    finally:
        gpt.mtp.runs = False


def share_embedding_copy(gpt) -> None:
    """On a last stage that is not the first, the embedding copy the MTP layers embed with: marked as megatron-core
    marks a shared copy (left out of the gradient norm, counted once on the first stage). With tied embeddings it is
    the output weight too, and the output layer's own weight, which megatron-core allocates but never uses there, is
    dropped (its checkpoint then has none, as megatron-core expects)."""
    weight = gpt.embedding.word_embeddings.weight
    weight.shared = weight.shared_embedding = weight.is_embedding_or_output_parameter = True
    if gpt.share_embeddings_and_output_weights:
        gpt.output_layer.weight = None


def finalize_with_embedding_copy(finalize: Callable, embedding_group) -> Callable:
    """megatron-core's finalize_model_grads (`finalize`), then the word embeddings' gradients of the first stage and
    of the last stage's copy summed over `embedding_group`, so the two stay one weight (untied embeddings: megatron-core
    reduces tied ones itself). Set on both stages: the sum is collective over them."""
    import torch.distributed as dist

    def finalize_then_reduce(model: list, *args, **kwargs) -> None:
        finalize(model, *args, **kwargs)
        gpt = model[0]
        while hasattr(gpt, "module"):
            gpt = gpt.module
        dist.all_reduce(gpt.embedding.word_embeddings.weight.main_grad, group=embedding_group)

    return finalize_then_reduce


def next_tokens(targets: torch.Tensor, group, packed_seq_params=None) -> torch.Tensor:
    """Under context parallelism, this rank's slice of tokens [rows, T_local] -> the tokens one position further on,
    rolled across the CP group's slices as megatron-core's MTP layers roll their input tokens (a sequence's last
    position gets 0, which `target_weights` never counts). Collective over `group`."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    return roll_tensor(targets, shifts=-1, dims=-1, cp_group=group, packed_seq_params=packed_seq_params)[0]


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
