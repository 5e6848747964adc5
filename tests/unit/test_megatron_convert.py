"""HF <-> Megatron weight conversion (no processes, no megatron import): layouts, TP/PP shards, round trips."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.trainer.algorithms.losses import token_log_probs_and_entropy
from services.trainer.backends.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy
from services.trainer.checkpoint.megatron_convert import hf_to_megatron, layer_offset, megatron_to_hf
from services.trainer.models.arch import ModelArch

BASE = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


def tiny_arch(**overrides) -> ModelArch:
    values = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 1, "ffn_hidden_size": 4, "num_layers": 1,
              "num_attention_heads": 4, "num_query_groups": 2, "head_dim": 1, "norm_epsilon": 1e-6,
              "rope_theta": 1e4, "rope_scaling_factor": None, "max_position_embeddings": 8, "qkv_bias": False,
              "qk_layernorm": False, "tie_word_embeddings": True}
    return ModelArch(**{**values, **overrides})


def test_arch_reads_each_family():
    qwen3 = ModelArch.from_hf_config({**BASE, "model_type": "qwen3", "head_dim": 24,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert (qwen3.head_dim, qwen3.qk_layernorm, qwen3.qkv_bias, qwen3.rope_theta) == (24, True, False, 5e5)
    qwen2 = ModelArch.from_hf_config({**BASE, "model_type": "qwen2", "tie_word_embeddings": True})
    assert (qwen2.head_dim, qwen2.qkv_bias, qwen2.qk_layernorm, qwen2.tie_word_embeddings) == (8, True, False, True)
    llama = ModelArch.from_hf_config({**BASE, "model_type": "llama", "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 5e5}})
    assert (llama.rope_scaling_factor, llama.rope_theta, llama.qkv_bias) == (32.0, 5e5, False)
    assert qwen3.padded_vocab_size(1) == 384 and qwen3.padded_vocab_size(2) == 512


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}},
     "rope"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "qwen3", "hidden_act": "gelu"}, "hidden_act"),
])
def test_arch_rejects_what_the_model_spec_cannot_express(overrides, message):
    with pytest.raises(InvalidArgument, match=message):
        ModelArch.from_hf_config({**BASE, **overrides})


def test_arch_checks_the_parallel_layout():
    arch = ModelArch.from_hf_config({**BASE, "model_type": "qwen3"})
    arch.check_parallel(tp_size=2, pp_size=2)
    with pytest.raises(InvalidArgument, match="tensor_model_parallel_size 4 must divide num_key_value_heads 2"):
        arch.check_parallel(tp_size=4, pp_size=1)
    with pytest.raises(InvalidArgument, match="pipeline_model_parallel_size 3 must divide num_hidden_layers 2"):
        arch.check_parallel(tp_size=1, pp_size=3)
    assert layer_offset(arch, pp_rank=1, pp_size=2) == 1


def one_layer(arch: ModelArch, **tensors) -> dict[str, torch.Tensor]:
    """A full HF state of `arch` (1 layer) with the given tensors of layer 0, zeros elsewhere."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    state = {"model.embed_tokens.weight": torch.zeros(arch.vocab_size, h), "model.norm.weight": torch.zeros(h)}
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (arch.num_attention_heads * d, h),
              "self_attn.k_proj.weight": (arch.num_query_groups * d, h),
              "self_attn.v_proj.weight": (arch.num_query_groups * d, h),
              "self_attn.o_proj.weight": (h, arch.num_attention_heads * d),
              "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    for name, shape in shapes.items():
        state[f"model.layers.0.{name}"] = tensors.get(name.split(".")[-2], torch.zeros(shape))
    return state


def test_qkv_is_fused_by_query_group_and_split_by_group_over_tp():
    arch = tiny_arch()  # 4 query heads in 2 groups, head_dim 1, hidden 1
    q, k, v = (torch.tensor(x, dtype=torch.float32).unsqueeze(-1) for x in ([0, 1, 2, 3], [10, 11], [20, 21]))
    hf = one_layer(arch, q_proj=q, k_proj=k, v_proj=v)
    full = hf_to_megatron(hf, arch)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert full.squeeze(-1).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    shards = [hf_to_megatron(hf, arch, tp_rank=r, tp_size=2)["decoder.layers.0.self_attention.linear_qkv.weight"]
              for r in range(2)]
    assert [s.squeeze(-1).tolist() for s in shards] == [[0, 1, 10, 20], [2, 3, 11, 21]]
    back = dict(megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", shards, arch))
    assert torch.equal(back["model.layers.0.self_attn.q_proj.weight"], q)
    assert torch.equal(back["model.layers.0.self_attn.v_proj.weight"], v)


def test_fc1_holds_this_ranks_gate_then_up_rows():
    arch = tiny_arch()
    gate, up = torch.arange(4.0).unsqueeze(-1), torch.arange(10.0, 14.0).unsqueeze(-1)
    hf = one_layer(arch, gate_proj=gate, up_proj=up)
    shards = [hf_to_megatron(hf, arch, tp_rank=r, tp_size=2)["decoder.layers.0.mlp.linear_fc1.weight"]
              for r in range(2)]
    assert [s.squeeze(-1).tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    back = dict(megatron_to_hf("decoder.layers.0.mlp.linear_fc1.weight", shards, arch))
    assert torch.equal(back["model.layers.0.mlp.gate_proj.weight"], gate)
    assert torch.equal(back["model.layers.0.mlp.up_proj.weight"], up)


def test_vocab_is_padded_with_zero_rows_and_trimmed_on_export():
    arch = tiny_arch(tie_word_embeddings=False)
    hf = {**one_layer(arch), "model.embed_tokens.weight": torch.arange(10.0).unsqueeze(-1),
          "lm_head.weight": -torch.arange(10.0).unsqueeze(-1)}
    shards = [hf_to_megatron(hf, arch, tp_rank=r, tp_size=2) for r in range(2)]
    embedding = [s["embedding.word_embeddings.weight"] for s in shards]
    assert [e.shape[0] for e in embedding] == [128, 128]  # 10 -> 256 rows over 2 ranks
    assert embedding[0][:10].squeeze(-1).tolist() == list(range(10)) and not embedding[0][10:].any()
    assert not embedding[1].any()
    (name, tensor), = megatron_to_hf("output_layer.weight", [s["output_layer.weight"] for s in shards], arch)
    assert name == "lm_head.weight" and torch.equal(tensor, hf["lm_head.weight"])


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def hf_state(request) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """A real transformers model's state (random values, norms and biases included) and its ModelArch."""
    import transformers

    config_cls, model_cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                             "llama": ("LlamaConfig", "LlamaForCausalLM")}[request.param]
    kwargs = {**BASE, "tie_word_embeddings": request.param == "qwen2"}
    kwargs.pop("model_type", None)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    state = {name: torch.randn_like(t) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return ModelArch.from_hf_config(config), state


@pytest.mark.parametrize(("tp", "pp", "te_names"), [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, True)])
def test_round_trip_is_exact_for_every_family_and_layout(hf_state, tp, pp, te_names):
    arch, hf = hf_state
    exported: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        ranks = [hf_to_megatron(hf, arch, tp_rank=r, tp_size=tp, pp_rank=pp_rank, pp_size=pp, te_names=te_names)
                 for r in range(tp)]
        assert all(r.keys() == ranks[0].keys() for r in ranks)
        local = ranks[0]
        assert ("embedding.word_embeddings.weight" in local) == (pp_rank == 0)
        assert ("decoder.final_layernorm.weight" in local) == (pp_rank == pp - 1)
        # a tied output layer exists only on a last stage that does not hold the embedding
        assert ("output_layer.weight" in local) == (pp_rank == pp - 1 and (not arch.tie_word_embeddings or pp > 1))
        assert ("decoder.layers.0.self_attention.linear_qkv.bias" in local) == arch.qkv_bias
        assert ("decoder.layers.0.self_attention.q_layernorm.weight" in local) == arch.qk_layernorm
        assert ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in local) == te_names
        assert not any(f"decoder.layers.{arch.num_layers // pp}." in name for name in local)
        qkv = local["decoder.layers.0.self_attention.linear_qkv.weight"]
        heads = arch.num_attention_heads + 2 * arch.num_query_groups
        assert qkv.shape == (heads * arch.head_dim // tp, arch.hidden_size)
        assert local["decoder.layers.0.mlp.linear_fc2.weight"].shape == (arch.hidden_size, arch.ffn_hidden_size // tp)
        for name in local:
            for hf_name, tensor in megatron_to_hf(name, [r[name] for r in ranks], arch,
                                                  offset=layer_offset(arch, pp_rank=pp_rank, pp_size=pp)):
                assert hf_name not in exported, hf_name
                exported[hf_name] = tensor
    assert exported.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(exported[name], tensor), name


def test_vocab_parallel_log_probs_match_the_reference_and_skip_padding():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 16, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    padded = torch.cat([logits, torch.full((2, 5, 5), 50.0)], dim=-1)  # huge logits in the padded vocab
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(padded[..., :16 + 5], targets, vocab_size=16,
                                                              temperature=0.7)
    want_lp, want_ent = token_log_probs_and_entropy(logits, targets, temperature=0.7)
    torch.testing.assert_close(log_probs, want_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, want_ent, atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad((log_probs + 0.3 * entropy).sum(), logits)
    (want_grad,) = torch.autograd.grad((want_lp + 0.3 * want_ent).sum(), logits)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=0)
