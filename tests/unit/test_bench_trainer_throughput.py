"""bench/trainer_throughput.py's compiled phase: its JSON keys from hand-made timings, each named in the docstring, and
its flags refused where they cannot apply."""

from __future__ import annotations

import pytest

from bench import trainer_throughput

PHASE = {"num_tokens": 2048, "graphs": 7,
         "seconds": {"fsdp": 2.0, "fsdp compiled": 1.6, "megatron": 3.0, "megatron compiled": 3.2},
         "warm_up_s": {"fsdp": 2.5, "fsdp compiled": 32.5, "megatron": 3.5, "megatron compiled": 3.0}}


def test_compiled_keys_are_ratios_to_eager_and_compile_seconds():
    result = trainer_throughput.compiled_result(PHASE)
    assert result["compiled_vs_eager_fsdp"] == 1.25  # 2.0 s eager / 1.6 s compiled
    assert result["compiled_vs_eager_megatron"] == pytest.approx(0.938)  # 3.0 / 3.2: slower compiled
    assert result["compile_s_fsdp"] == 30.0  # 32.5 s first compiled step - 2.5 s first eager step
    assert result["compile_s_megatron"] == 0.0  # a compiled first step quicker than eager's: no negative time
    assert result["compiled_graphs"] == 7
    assert result["compiled_tokens_per_s"] == {"fsdp": 1024.0, "fsdp compiled": 1280.0, "megatron": 682.7,
                                               "megatron compiled": 640.0}


def test_every_compiled_key_is_documented():
    for key in trainer_throughput.compiled_result(PHASE):
        assert f'"{key}"' in trainer_throughput.__doc__, key


@pytest.mark.parametrize("flags", [["--moe-only", "--compiled"], ["--moe-only", "--compiled-only"],
                                   ["--compiled", "--compiled-only"]])
def test_phases_that_cannot_run_together_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        trainer_throughput.main(["--device", "cpu", *flags])
    assert "--compiled" in capsys.readouterr().err


def test_matrix_flops_count_every_slot_through_the_layers_and_loss_rows_through_the_head():
    model = dict(hidden_size=2, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                 intermediate_size=3, vocab_size=5)
    # projections 2·2·(2 + 2) = 16 and MLP 3·2·3 = 18 a layer: 10 slots × (2·16 + 1·18) + 4 loss rows × (18 + 5·2)
    assert trainer_throughput.matrix_flops(model, row_slots=10, loss_rows=4) == 6 * (10 * 50 + 4 * 28)


def test_padded_slots_follow_each_backends_schedule():
    # fsdp cuts the samples in order: [9, 8] and [1, 2], padded to 9 and 2; megatron deals the longest first into
    # the lightest micro-batch: [9, 1] and [8, 2], padded to 9 and 8
    assert trainer_throughput.tail_padded_slots([9, 8, 1, 2], micro_batch_size=2) == {"fsdp": 2 * 9 + 2 * 2,
                                                                                      "megatron": 2 * 9 + 2 * 8}
