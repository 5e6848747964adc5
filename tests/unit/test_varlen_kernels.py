"""Packed-row attention through the real variable-length kernels: flex attention's block mask (eager on the CPU,
compiled on CUDA), on CUDA torch's varlen flash attention, and on CPU the query tiles, each against one causal
attention per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.trainer.batching import varlen

CU_SEQLENS = [0, 37, 130, 131, 200]  # uneven sequences, one of a single token, none a multiple of a block


def _inputs(device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(200, heads, 32, generator=gen) for heads in (4, 2, 2))
    return [t.to(device=device, dtype=dtype) for t in (query, key, value)], torch.tensor(CU_SEQLENS)


def _per_sequence(query, key, value, cu_seqlens):
    """The CPU path: one causal attention per sequence, in float32."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    out = [F.scaled_dot_product_attention(*(t.float().cpu().transpose(0, 1)[None] for t in qkv), is_causal=True,
                                          enable_gqa=True)[0]
           for qkv in zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True)]
    return torch.cat(out, dim=1).transpose(0, 1)


def test_flex_attentions_block_mask_keeps_each_sequence_to_itself(monkeypatch):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(varlen, "_flex", lambda: (flex_attention, create_block_mask))  # eager: no compile here
    (query, key, value), cu_seqlens = _inputs("cpu", torch.float32)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
    got = varlen.flex_causal_attention(q, k, v, cu_seqlens)[0].transpose(0, 1)
    torch.testing.assert_close(got, _per_sequence(query, key, value, cu_seqlens), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU kernels run in make gpu-check")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_varlen_kernels_equal_one_attention_per_sequence(dtype):
    (query, key, value), cu_seqlens = _inputs("cuda", dtype)
    kernel = "flash" if varlen.flash_applies(query) else "flex" if varlen.flex_applies(query) else "masked sdpa"
    print(f"{dtype}: {kernel}")
    assert kernel != "masked sdpa", "CUDA has neither varlen flash nor flex attention"
    got = varlen.varlen_causal_attention(query, key, value, cu_seqlens.cuda(), 93)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), _per_sequence(query, key, value, cu_seqlens), atol=tol, rtol=tol)


@pytest.mark.parametrize("tile", [1, 4, 64])
@pytest.mark.parametrize("path", ["cpu flash node", "recorded tiles"])
def test_cpu_query_tiles_equal_one_attention_per_sequence_in_values_and_gradients(tile, path):
    """Tiles of 4 rows cut the sequences of 37, 93 and 69 tokens inside and at their ends (93 = 23 tiles and one
    row); one of 1 row sees only itself. Values and the gradients of query, key and value against one causal
    attention per sequence and against the whole row under the block-diagonal causal mask, by both paths: the CPU
    flash kernel in one autograd node (no dropout) and the attention calls autograd records (dropout, other
    devices)."""
    (query, key, value), cu_seqlens = _inputs("cpu", torch.float32)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    grad = torch.randn(query.shape, generator=torch.Generator().manual_seed(1))

    def run(attention):
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        out = attention(*inputs)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in inputs]

    if path == "cpu flash node":
        got = run(lambda q, k, v: varlen.tiled_causal_attention(q, k, v, lengths, tile=tile))
    else:
        got = run(lambda q, k, v: varlen._recorded_tiles(q, k, v, lengths, scale=None, dropout_p=0.0, tile=tile))
    per_sequence = run(lambda q, k, v: _per_sequence(q, k, v, cu_seqlens))
    mask = varlen.block_causal_mask(cu_seqlens, query.shape[0])
    dense = run(lambda q, k, v: F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)),
                                                               attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    for name, a, b, c in zip(("output", "grad query", "grad key", "grad value"), got, per_sequence, dense,
                             strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5, msg=name)


def test_the_cpu_path_runs_the_tiles():
    """varlen_causal_attention on CPU takes the tiles: the same output as tiled_causal_attention, bit for bit."""
    (query, key, value), cu_seqlens = _inputs("cpu", torch.float32)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    assert torch.equal(varlen.varlen_causal_attention(query, key, value, cu_seqlens, 93),
                       varlen.tiled_causal_attention(query, key, value, lengths))


def test_the_cpu_tiles_are_one_autograd_node_and_take_bfloat16():
    """Without dropout the CPU tiles are one node (the flash kernel's backward called per tile), with dropout the
    recorded attention calls; in bfloat16 the node's output is the per-sequence float32 attention's within bfloat16's
    rounding."""
    (query, key, value), cu_seqlens = _inputs("cpu", torch.float32)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    query.requires_grad_()
    assert type(varlen.tiled_causal_attention(query, key, value, lengths).grad_fn).__name__ == "_CpuFlashTilesBackward"
    dropped = varlen.tiled_causal_attention(query, key, value, lengths, dropout_p=0.5)
    assert type(dropped.grad_fn).__name__ != "_CpuFlashTilesBackward"
    half = [t.detach().bfloat16() for t in (query, key, value)]
    got = varlen.tiled_causal_attention(*half, lengths)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _per_sequence(*half, cu_seqlens), atol=2e-2, rtol=2e-2)
