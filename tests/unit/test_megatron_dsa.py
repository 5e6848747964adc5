"""GLM-5's sparse attention pieces on CPU: the indexer's Hadamard rotation in PyTorch (megatron-core's is a CUDA
kernel, bf16 only) against the hand-written order-4 transform, and the indexer weights' HF <-> Megatron round trip with
its per-head rotation of the rope dimensions."""

from __future__ import annotations

import torch

from services.trainer.backends.megatron.dsa import hadamard_rotation
from services.trainer.models import glm_moe_dsa
from services.trainer.models.arch import MLAShape, ModelArch, SparseAttentionShape


def test_the_hadamard_rotation_is_the_orthonormal_sylvester_transform_and_keeps_dot_products():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    # H4 / 2: rows (1 1 1 1), (1 -1 1 -1), (1 1 -1 -1), (1 -1 -1 1)
    assert torch.equal(hadamard_rotation(x), torch.tensor([[5.0, -1.0, -2.0, 0.0]]))
    q, k = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(7, 16, dtype=torch.float64)
    torch.testing.assert_close(hadamard_rotation(q) @ hadamard_rotation(k).T, q @ k.T)


def test_the_indexer_weights_round_trip_with_each_heads_rope_dimensions_moved_last():
    arch = ModelArch(model_type="glm_moe_dsa", vocab_size=8, hidden_size=6, ffn_hidden_size=8, num_layers=1,
                     num_attention_heads=2, num_query_groups=2, head_dim=4, norm_epsilon=1e-5, rope_theta=1e4,
                     rope_scaling_factor=None, max_position_embeddings=16, qkv_bias=False, qk_layernorm=False,
                     tie_word_embeddings=False, mla=MLAShape(5, 4, 2, 2, 4),
                     dsa=SparseAttentionShape(index_n_heads=2, index_head_dim=4, index_topk=2))
    src, dst = "model.layers.0.", "decoder.layers.0."
    hf = {src + glm_moe_dsa.HF_INDEXER + name: torch.randn(shape) for name, shape in (
        ("wq_b.weight", (8, 5)), ("wk.weight", (4, 6)), ("k_norm.weight", (4,)), ("k_norm.bias", (4,)),
        ("weights_proj.weight", (2, 6)))}
    mg = glm_moe_dsa.hf_to_megatron_indexer(hf, arch, src, dst)
    wq_b = mg[dst + glm_moe_dsa.MG_INDEXER + "linear_wq_b.weight"]
    hf_wq_b = hf[src + glm_moe_dsa.HF_INDEXER + "wq_b.weight"]
    # head h's rows [rope 0, rope 1, rest 2, rest 3] become [rest 2, rest 3, rope 0, rope 1]
    assert torch.equal(wq_b, hf_wq_b[[2, 3, 0, 1, 6, 7, 4, 5]])
    back = dict(pair for name, tensor in mg.items() for pair in glm_moe_dsa.megatron_to_hf_indexer(
        name.removeprefix(dst), [tensor], arch, src))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
