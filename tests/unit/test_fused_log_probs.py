"""The fused, chunked log-probs and entropy equal the logits path (project onto the vocabulary, log-softmax) in
values and in the gradients of the hidden states and the LM head, on one rank and vocab-parallel over two."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from services.trainer.algorithms import fused_log_probs
from services.trainer.algorithms.fused_log_probs import fused_log_probs_and_entropy
from services.trainer.algorithms.losses import token_log_probs_and_entropy
from testkit import gloo_ranks

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(tokens: int = 37, hidden: int = 16, vocab: int = 50, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * 0.5
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    weights = torch.randn(2, tokens, generator=gen)  # what the loss weighs each token's log-prob and entropy by
    return h, w, targets, weights


def _loss_and_grads(fn, h, w, targets, weights, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    log_probs, entropy = fn(h, w, targets, **kw)
    loss = (log_probs * weights[0]).sum() + (0 if entropy is None else (entropy * weights[1]).sum())
    loss.backward()
    return log_probs.detach(), None if entropy is None else entropy.detach(), h.grad, w.grad


def _unfused(h, w, targets, *, temperature=1.0, with_entropy=True, entropy_grad=True, **_):
    return token_log_probs_and_entropy(h @ w.t(), targets, temperature=temperature, with_entropy=with_entropy,
                                       entropy_grad=entropy_grad)


@pytest.mark.parametrize("chunk_size", [1, 8, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_logits_path(chunk_size, temperature):
    h, w, targets, weights = _inputs()
    want = _loss_and_grads(_unfused, h, w, targets, weights, temperature=temperature)
    got = _loss_and_grads(fused_log_probs_and_entropy, h, w, targets, weights, temperature=temperature,
                          chunk_size=chunk_size)
    for name, a, b in zip(("log_probs", "entropy", "grad hidden", "grad weight"), got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_the_entropy_in_blocks_of_rows_equals_the_logits_path(monkeypatch):
    """Off CUDA the entropy's row-wise dot product runs in blocks of ROW_DOT_BLOCK elements: 3 rows of 50 here, so a
    chunk of 8 rows takes three blocks, the last one short."""
    monkeypatch.setattr(fused_log_probs, "ROW_DOT_BLOCK", 150)
    h, w, targets, weights = _inputs(seed=3)
    want = _loss_and_grads(_unfused, h, w, targets, weights)
    got = _loss_and_grads(fused_log_probs_and_entropy, h, w, targets, weights, chunk_size=8)
    for name, a, b in zip(("log_probs", "entropy", "grad hidden", "grad weight"), got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_without_entropy_or_its_gradient():
    h, w, targets, weights = _inputs(seed=1)
    want = _loss_and_grads(_unfused, h, w, targets, weights, with_entropy=False)
    got = _loss_and_grads(fused_log_probs_and_entropy, h, w, targets, weights, with_entropy=False, chunk_size=5)
    assert got[1] is None
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[2], want[2], **TOL)
    torch.testing.assert_close(got[3], want[3], **TOL)
    # a metric-only entropy: its value, no gradient through it
    want = _loss_and_grads(_unfused, h, w, targets, weights, entropy_grad=False)
    got = _loss_and_grads(fused_log_probs_and_entropy, h, w, targets, weights, entropy_grad=False, chunk_size=5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


class _ProjectionCount(TorchDispatchMode):
    """Counts the matmuls whose output is [tokens × vocab]: the projections onto the vocabulary."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default and out.shape[-1] == self.vocab:
            self.count += 1
        return out


@pytest.mark.parametrize("chunk_size, projections", [(1024, 1), (8, 5 + 4)])
def test_the_backward_reuses_the_last_chunk_and_a_second_backward_recomputes_it(chunk_size, projections):
    """37 tokens: one chunk is projected once, forward only; five chunks of 8 five times forward and four times
    backward (the last chunk's softmax kept). A second backward (retain_graph) has nothing kept: it recomputes all,
    to the same gradients."""
    h, w, targets, weights = _inputs(seed=5)
    want = _loss_and_grads(_unfused, h, w, targets, weights)
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with _ProjectionCount(w.shape[0]) as counted:
        log_probs, entropy = fused_log_probs_and_entropy(h, w, targets, chunk_size=chunk_size)
        loss = (log_probs * weights[0]).sum() + (entropy * weights[1]).sum()
        loss.backward(retain_graph=True)
    assert counted.count == projections
    torch.testing.assert_close(h.grad, want[2], **TOL)
    torch.testing.assert_close(w.grad, want[3], **TOL)
    first = h.grad.clone(), w.grad.clone()
    h.grad, w.grad = None, None
    loss.backward()
    torch.testing.assert_close(h.grad, first[0], **TOL)
    torch.testing.assert_close(w.grad, first[1], **TOL)


class _FreshVocabTensors(TorchDispatchMode):
    """Counts the op outputs of at least `size` elements that are new memory (not an input's, as an in-place op's
    output is)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.count = size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.size and t.untyped_storage().data_ptr() not in inputs:
                self.count += 1
        return out


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_off_cuda_the_softmax_terms_overwrite_the_projection(monkeypatch, entropy_grad):
    """Off CUDA e^(z - m) goes into the projection's own [tokens × vocab] buffer, a block of 3 rows at a time, when
    no entropy gradient needs z - m after the forward: the projection is the one such tensor of the forward and
    backward (the exponentials beside it would be a second). With the entropy's gradient the kept chunk holds both.
    Values and gradients equal the logits path either way."""
    monkeypatch.setattr(fused_log_probs, "ROW_DOT_BLOCK", 150)
    h, w, targets, weights = _inputs(seed=6)
    want = _loss_and_grads(_unfused, h, w, targets, weights, entropy_grad=entropy_grad)
    with _FreshVocabTensors(h.shape[0] * w.shape[0]) as fresh:
        got = _loss_and_grads(fused_log_probs_and_entropy, h, w, targets, weights, entropy_grad=entropy_grad)
    assert fresh.count == (2 if entropy_grad else 1)
    for name, a, b in zip(("log_probs", "entropy", "grad hidden", "grad weight"), got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_batched_shapes_and_vocab_padding_rows_are_left_out():
    h, w, targets, weights = _inputs(tokens=12, vocab=20, seed=2)
    padded = torch.cat([w, torch.randn(4, w.shape[1]) * 5])  # four padding rows that must not enter the softmax
    lp, ent = fused_log_probs_and_entropy(h.view(3, 4, -1), padded, targets.view(3, 4), vocab_size=20, chunk_size=5)
    want_lp, want_ent = _unfused(h, w, targets)
    torch.testing.assert_close(lp, want_lp.view(3, 4), **TOL)
    torch.testing.assert_close(ent, want_ent.view(3, 4), **TOL)
    hh, pw = h.clone().requires_grad_(), padded.clone().requires_grad_()
    fused_log_probs_and_entropy(hh, pw, targets, vocab_size=20)[0].sum().backward()
    assert torch.equal(pw.grad[20:], torch.zeros(4, w.shape[1]))


def test_bf16_autocast_matches_the_autocast_linear():
    """Under autocast the projection runs in bfloat16 as the model's nn.Linear head would; the softmax in float32."""
    h, w, targets, weights = _inputs(seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(lambda h, w, t, **kw: token_log_probs_and_entropy(torch.nn.functional.linear(h, w), t),
                               h, w, targets, weights)
        got = _loss_and_grads(fused_log_probs_and_entropy, h, w, targets, weights, chunk_size=16)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], want[2], atol=2e-2, rtol=2e-2)  # bf16 gradient matmuls, in another order
    torch.testing.assert_close(got[3], want[3], atol=2e-2, rtol=2e-2)


def test_bad_arguments_are_refused():
    h, w, targets, _ = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        fused_log_probs_and_entropy(h, w, targets, chunk_size=0)
    with pytest.raises(ValueError, match="disagree"):
        fused_log_probs_and_entropy(h, w, targets[:-1])


def _tp_rank(rank: int, world: int) -> dict:
    h, w, targets, weights = _inputs(vocab=50, seed=4)
    part = 26  # the vocab padded to 52 = 2 × 26: rank 1 holds rows 26..51, its last two padding
    padded = torch.cat([w, torch.zeros(2, w.shape[1])])
    mine = padded[rank * part:(rank + 1) * part]
    hh, ww = h.clone().requires_grad_(), mine.clone().requires_grad_()
    lp, ent = fused_log_probs_and_entropy(hh, ww, targets, temperature=0.8, chunk_size=7, vocab_size=50,
                                          vocab_start=rank * part, group=dist.group.WORLD)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    grad_h = hh.grad.clone()
    dist.all_reduce(grad_h)  # the caller sums the hidden states' gradient over the group (Megatron's output layer)
    return {"lp": lp.detach(), "ent": ent.detach(), "grad_h": grad_h, "grad_w": ww.grad}


def test_vocab_parallel_over_two_ranks_equals_the_whole_vocabulary():
    ranks = gloo_ranks.run(_tp_rank)
    h, w, targets, weights = _inputs(vocab=50, seed=4)
    lp, ent, grad_h, grad_w = _loss_and_grads(_unfused, h, w, targets, weights, temperature=0.8)
    for got in ranks:
        torch.testing.assert_close(got["lp"], lp, **TOL)
        torch.testing.assert_close(got["ent"], ent, **TOL)
        torch.testing.assert_close(got["grad_h"], grad_h, **TOL)
    torch.testing.assert_close(torch.cat([ranks[0]["grad_w"], ranks[1]["grad_w"][:24]]), grad_w, **TOL)
    assert torch.equal(ranks[1]["grad_w"][24:], torch.zeros(2, w.shape[1]))
