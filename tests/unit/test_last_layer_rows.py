"""The last layer's MLP on the fused head's positions alone: equal to the whole MLP there (values and gradients), zero
elsewhere, in transformers' layout and megatron-core's; a MoE block is never cut."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3MoeConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from services.trainer.backends.last_layer_rows import is_dense_mlp, mlp_on_rows


def _mlp() -> Qwen3MLP:
    torch.manual_seed(0)
    return Qwen3MLP(Qwen3Config(hidden_size=8, intermediate_size=12))


@pytest.mark.parametrize("sequence_first", [False, True])
def test_the_marked_rows_equal_the_whole_mlp_and_the_others_are_zero(sequence_first):
    mlp = _mlp()
    positions = torch.tensor([[False, True, True, False, False], [True, False, True, True, False]])  # [b, L]
    hidden = torch.randn(2, 5, 8)
    if sequence_first:  # megatron-core's [L, b, H]
        hidden = hidden.transpose(0, 1).contiguous()
    x_whole, x_cut = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    whole = mlp(x_whole)
    with mlp_on_rows(mlp, positions, sequence_first=sequence_first):
        cut = mlp(x_cut)
    assert "forward" not in vars(mlp)  # the module as it was after
    marked = positions.t() if sequence_first else positions
    torch.testing.assert_close(cut[marked], whole[marked], atol=1e-6, rtol=1e-6)
    assert torch.equal(cut[~marked], torch.zeros_like(cut[~marked]))
    weights = torch.randn_like(whole) * marked[..., None]  # a loss that reads the marked rows alone
    (whole * weights).sum().backward()
    mlp_grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    with mlp_on_rows(mlp, positions, sequence_first=sequence_first):
        (mlp(x_cut) * weights).sum().backward()
    torch.testing.assert_close(x_cut.grad, x_whole.grad, atol=1e-6, rtol=1e-6)
    for got, want in zip((p.grad for p in mlp.parameters()), mlp_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_an_input_of_another_shape_runs_whole_and_none_leaves_the_mlp_as_it_is():
    mlp = _mlp()
    hidden = torch.randn(3, 4, 8)
    with mlp_on_rows(mlp, torch.ones(2, 5, dtype=torch.bool), sequence_first=False):
        torch.testing.assert_close(mlp(hidden), Qwen3MLP.forward(mlp, hidden))
    with mlp_on_rows(mlp, None, sequence_first=False):
        assert "forward" not in vars(mlp)


def test_only_a_dense_mlp_is_cut():
    assert is_dense_mlp(_mlp())
    moe = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4,
                                                num_experts_per_tok=2))
    assert not is_dense_mlp(moe) and not is_dense_mlp(None)
