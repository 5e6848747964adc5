"""bench/trainer_step_profile.py: operators sorted into kinds by name and operand shapes, their self time summed per
step (the host's, or on CUDA the kernels' without counting a kernel twice), and the bench end to end on a small
model: each kind's padded / packed ratio from the same two profiles."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from bench import trainer_step_profile as profile
from bench import trainer_throughput

VOCAB = 4096


@pytest.mark.parametrize("name, shapes, kind", [
    ("aten::mm", [[992, 256], [256, 4096]], "LM head"),  # the head's forward
    ("aten::mm", [[4096, 992], [992, 256]], "LM head"),  # its weight's gradient
    ("aten::mm", [[1088, 256], [256, 768]], "other matrix products"),
    ("aten::addmm", [[768], [1088, 256], [256, 768], [], []], "other matrix products"),
    ("aten::bmm", [[4, 64, 4096], [4, 4096, 64]], "LM head"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [[1, 4, 64, 64]], "attention"),
    ("_CpuFlashTilesBackward", [], "attention"),
    ("aten::_fused_adamw_", [[]], "optimizer"),
    ("Optimizer.step#AdamW.step", [], "optimizer"),
    ("aten::_foreach_norm", [[]], "optimizer"),
    ("aten::mul", [[1, 1088, 4096], [1, 1088, 4096]], "everything else"),  # a vocab-wide product is not a matmul
    ("aten::silu_backward", [[1, 1088, 768], [1, 1088, 768]], "everything else"),
])
def test_operators_fall_into_their_kinds(name, shapes, kind):
    assert profile.kind_of(name, shapes, VOCAB) == kind


def _event(key, shapes, cpu_us, device_us=0.0, on_device=False):
    device_type = torch.autograd.DeviceType.CUDA if on_device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(key=key, input_shapes=shapes, self_cpu_time_total=cpu_us,
                           self_device_time_total=device_us, device_type=device_type)


def test_tally_sums_self_time_per_step_and_counts_each_kernel_once():
    events = [_event("aten::mm", [[8, 256], [256, VOCAB]], cpu_us=3000, device_us=900),
              _event("aten::mm", [[8, 256], [256, 768]], cpu_us=5000, device_us=1500),
              _event("aten::mul", [[8, 768], [8, 768]], cpu_us=1000, device_us=100),
              _event("sm90_gemm_kernel", [], cpu_us=0, device_us=2400, on_device=True)]  # the mms' own kernels
    host = profile.tally(events, VOCAB, steps=2, on_device=False)
    # (3000 + 5000 + 1000) µs over 2 steps: 1.5 + 2.5 + 0.5 ms
    assert host == {"LM head": 1.5, "other matrix products": 2.5, "attention": 0.0, "optimizer": 0.0,
                    "everything else": 0.5, "total": 4.5}
    device = profile.tally(events, VOCAB, steps=2, on_device=True)
    # the kernels' time through their operators alone: (900 + 1500 + 100) µs over 2 steps
    assert device["LM head"] == 0.45 and device["other matrix products"] == 0.75
    assert device["total"] == pytest.approx(1.25)


def test_a_real_profile_finds_the_head_and_the_attention():
    hidden = torch.randn(64, 32)
    head = torch.randn(VOCAB, 32, requires_grad=True)
    q = torch.randn(1, 2, 64, 16, requires_grad=True)

    def step():
        logits = hidden @ head.t()
        attention = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        (logits.logsumexp(-1).sum() + attention.sum()).backward()

    ms = profile.profile_step(step, steps=3, vocab_size=VOCAB, device=torch.device("cpu"))
    assert ms["LM head"] > 0 and ms["attention"] > 0 and ms["everything else"] > 0
    assert ms["total"] == pytest.approx(sum(ms[kind] for kind in profile.KINDS))


def test_the_bench_compares_packed_and_padded_kind_by_kind(monkeypatch):
    tiny = dict(model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32),
                num_samples=4, prompt_len=8, response_len=8, micro_batch_size=2,
                long_tail=dict(num_samples=8, prompt_len=8, max_response_len=64))
    monkeypatch.setitem(trainer_throughput.SHAPES, "cpu", tiny)
    before, logging_before = torch.get_num_threads(), logging.root.manager.disable
    try:
        result = profile.main(["--device", "cpu", "--steps", "1", "--threads", "1", "--backends", "fsdp"])
    finally:
        torch.set_num_threads(before)
    assert logging.root.manager.disable == logging_before  # the bench leaves the process's logging as it was
    packed, padded = result["ms"]["fsdp packed"], result["ms"]["fsdp padded"]
    assert packed["LM head"] > 0 and padded["LM head"] > 0  # the vocabulary of 512 found in the head's products
    # the ratio from the unrounded times; the JSON's milliseconds are rounded to 0.01
    assert result["padded_over_packed"]["fsdp"]["total"] == pytest.approx(padded["total"] / packed["total"], rel=5e-3)
    for key in result:
        assert f'"{key}"' in profile.__doc__, key
    with pytest.raises(SystemExit):
        profile.main(["--backends", "fsdp,deepspeed"])
