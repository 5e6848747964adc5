"""The gated delta rule the megatron backend scans with: token by token against hand-derived numbers, the chunked
PyTorch scan (off CUDA) against it across a chunk boundary and over packed sequences, fla's fused scan (CUDA only)
against the PyTorch one; and the HF <-> Megatron conversion of Qwen3.5's and Qwen3-Next's gated delta-nets and
gated attention at TP=2 giving back every HF tensor."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.backends.megatron.gated_delta_net import (
    chunked_gated_delta_rule,
    has_fused_kernels,
    recurrent_gated_delta_rule,
)


def _inputs(seq: int, *, heads: int = 2, dk: int = 4, dv: int = 3, seed: int = 0, device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, seq, heads, dk, generator=generator), dim=-1)
            for _ in range(2))
    v = torch.randn(1, seq, heads, dv, generator=generator)
    g = -torch.rand(1, seq, heads, generator=generator)  # decays in (e^-1, 1]
    beta = torch.rand(1, seq, heads, generator=generator)
    return [t.to(device) for t in (q, k, v, g, beta)]


def test_the_recurrent_rule_gives_the_hand_derived_outputs():
    # one head, dk = dv = 1: S1 = β1·k1·v1, o1 = S1·q1; S2 = e^g2·S1 + β2·k2·(v2 − e^g2·S1·k2), o2 = S2·q2
    q, k, v = torch.tensor([0.5, 2.0]), torch.tensor([1.0, 0.5]), torch.tensor([3.0, -1.0])
    g, beta = torch.tensor([0.0, math.log(0.5)]), torch.tensor([0.5, 1.0])
    s1 = 0.5 * 1.0 * 3.0
    decayed = 0.5 * s1
    s2 = decayed + 1.0 * 0.5 * (-1.0 - decayed * 0.5)
    out = recurrent_gated_delta_rule(q.view(1, 2, 1, 1), k.view(1, 2, 1, 1), v.view(1, 2, 1, 1), g.view(1, 2, 1),
                                     beta.view(1, 2, 1))
    torch.testing.assert_close(out.flatten(), torch.tensor([s1 * 0.5, s2 * 2.0]))


def test_the_chunked_pytorch_scan_is_the_recurrent_rule_across_chunks_and_packed_sequences():
    q, k, v, g, beta = _inputs(70 + 5)  # a sequence of 70 (over one 64-token chunk), then one of 5
    got = chunked_gated_delta_rule(q, k, v, g, beta, [0, 70, 75])
    for a, b in ((0, 70), (70, 75)):  # each sequence from a zero state
        want = recurrent_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])
        torch.testing.assert_close(got[:, a:b], want, atol=1e-5, rtol=0)


def test_the_fused_scan_on_cuda_is_the_pytorch_one():
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if not has_fused_kernels(device):
        pytest.skip("fla's fused chunked scan and causal-conv1d run on CUDA only, with both installed; "
                    f"here: cuda {torch.cuda.is_available()}")
    inputs = _inputs(75, dk=64, dv=64, device="cuda")
    fused = chunked_gated_delta_rule(*inputs, [0, 70, 75])
    reference = torch.cat([recurrent_gated_delta_rule(*(t[:, a:b] for t in inputs))
                           for a, b in ((0, 70), (70, 75))], dim=1)
    torch.testing.assert_close(fused, reference, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_hf_weights_go_through_two_tensor_parallel_ranks_and_come_back(family):
    from transformers import AutoModelForCausalLM

    from physarum.families import tiny_config
    from services.trainer.checkpoint.megatron_convert import fuse_experts, hf_to_megatron, megatron_to_hf
    from services.trainer.models.arch import ModelArch

    config = tiny_config(family, vocab_size=50, eos_id=0, hidden_size=64, num_layers=2)
    torch.manual_seed(0)
    hf = {name: t.detach() for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    arch = ModelArch.from_hf_config(config.to_dict())
    assert arch.linear_layers == (True, False) and arch.attention_output_gate and arch.zero_centered_norms
    shards = [hf_to_megatron(hf, arch, tp_rank=r, tp_size=2) for r in range(2)]
    replicated = ("norm.weight", "layernorm.weight", "router.weight", "gate_weight")
    pairs = []
    for name in shards[0]:
        parts = [shards[0][name]] if name.endswith(replicated) or ".local_experts." in name else \
            [s[name] for s in shards]
        pairs += megatron_to_hf(name, parts, arch)
    back = dict(fuse_experts(iter(pairs), arch))
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert back.keys() == hf.keys() - tied
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name


def test_a_multimodal_qwen3_5_checkpoint_gives_its_language_model():
    from transformers import AutoModelForCausalLM

    from physarum.families import tiny_config
    from services.trainer.checkpoint.megatron_convert import hf_to_megatron
    from services.trainer.models.arch import ModelArch

    config = tiny_config("qwen3_5", vocab_size=50, eos_id=0, hidden_size=64, num_layers=2)
    hf = AutoModelForCausalLM.from_config(config).state_dict()
    multimodal = {name.replace("model.", "model.language_model.", 1): t for name, t in hf.items()}
    multimodal["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)  # the vision tower, not read
    arch = ModelArch.from_hf_config({"model_type": "qwen3_5", "vision_config": {}, "text_config": config.to_dict()})
    want, got = hf_to_megatron(hf, arch, tp_rank=1, tp_size=2), hf_to_megatron(multimodal, arch, tp_rank=1, tp_size=2)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)
