"""Context parallelism's split of a packed micro-batch (Megatron's load-balanced chunks) and merge back, by hand;
its attention across the slices against the packed row's varlen attention; and the submit-time refusals: a backend
without CP (naming the one with it), a custom loss, a CP size that does not divide the trainer's ranks, a model
whose layers are not all full attention.

The two ranks' all-gather is stood in for by concatenating what each rank holds (`test_context_parallel` in
tests/integration runs the real one over gloo)."""

from __future__ import annotations

import json

import pytest
import torch

from services.common import plugins
from services.common.errors import InvalidArgument
from services.common.samples import Sample
from services.trainer.api import preflight as preflight_checks
from services.trainer.api.preflight import preflight
from services.trainer.api.spec import parse_spec
from services.trainer.backends.fsdp import context_parallel, cp_attention
from services.trainer.batching import packing, varlen
from services.trainer.batching.batch import build_rollout_batch

PAD = 0


def _batch():
    # lengths 5 and 3: padded to multiples of 2·CP = 4, 8 and 4
    return build_rollout_batch([Sample(tokens=[11, 12, 13, 14, 15], response_length=2),
                                Sample(tokens=[21, 22, 23], response_length=1)], pad_token_id=PAD)


def _group(rank: int) -> context_parallel.CPGroup:
    return context_parallel.CPGroup(size=2, rank=rank, group=None, dp_rank=0, dp_size=1, dp_group=None)


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence():
    # padded row: sequence 0 at 0..7 (chunks of 2: 0-1, 2-3, 4-5, 6-7), sequence 1 at 8..11 (chunks of 1)
    assert context_parallel.padded_lengths([5, 3], 2) == [8, 4]
    assert context_parallel.chunk_index([5, 3], 0, 2).tolist() == [0, 1, 6, 7, 8, 11]  # chunks 0 and 3
    assert context_parallel.chunk_index([5, 3], 1, 2).tolist() == [2, 3, 4, 5, 9, 10]  # chunks 1 and 2
    # CP 3: 2·CP = 6 chunks; a 7-token sequence pads to 12 (chunks of 2), rank 1 takes chunks 1 and 4
    assert context_parallel.chunk_index([7], 1, 3).tolist() == [2, 3, 8, 9]


def test_a_slice_carries_true_positions_and_next_token_targets_and_merges_back_in_packed_order():
    batch = _batch()
    pieces = [context_parallel.split(batch, _group(rank), PAD) for rank in (0, 1)]
    assert pieces[0].input_ids.tolist() == [[11, 12, PAD, PAD, 21, PAD]]
    assert pieces[0].position_ids.tolist() == [[0, 1, 6, 7, 0, 3]]
    assert pieces[0].targets.tolist() == [[12, 13, PAD, PAD, 22, PAD]]  # 12 follows 11; 13 lives on rank 1
    assert pieces[1].input_ids.tolist() == [[13, 14, 15, PAD, 22, 23]]
    assert pieces[1].position_ids.tolist() == [[2, 3, 4, 5, 1, 2]]
    assert pieces[1].targets.tolist() == [[14, 15, PAD, PAD, 23, PAD]]  # 15 and 23 end their sequences
    # gathered order: rank 0's padded positions 0 1 6 7 8 11, then rank 1's 2 3 4 5 9 10; the real tokens (0-4 and
    # 8-10 of the padded row) sit at gathered 0 1 6 7 8 and 4 10 11
    assert pieces[0].real_index.tolist() == [0, 1, 6, 7, 8, 4, 10, 11]
    gathered = torch.cat([p.input_ids[0] for p in pieces])
    assert gathered[pieces[0].real_index].tolist() == packing.pack(batch).input_ids[0].tolist()


def test_attention_across_the_slices_equals_the_whole_rows(monkeypatch):
    batch = _batch()
    pieces = [context_parallel.split(batch, _group(rank), PAD) for rank in (0, 1)]
    gen = torch.Generator().manual_seed(0)
    heads, groups, dim = 4, 2, 8  # grouped-query attention
    query, key, value = (torch.randn(12, n, dim, generator=gen) for n in (heads, groups, groups))  # padded row
    local = [context_parallel.chunk_index([5, 3], rank, 2) for rank in (0, 1)]
    monkeypatch.setattr(cp_attention, "all_gather",
                        lambda kv, group: torch.cat([torch.cat([key, value], -1)[idx] for idx in local]))
    real = torch.tensor([0, 1, 2, 3, 4, 8, 9, 10])
    expected = varlen.varlen_causal_attention(query[real], key[real], value[real], torch.tensor([0, 5, 8]), 5)
    whole = torch.zeros(12, heads, dim)
    for rank in (0, 1):
        whole[local[rank]] = cp_attention.causal_attention(query[local[rank]], key[local[rank]], value[local[rank]],
                                                           pieces[rank])
    assert torch.allclose(whole[real], expected, atol=1e-6)


BASE = {"hf_checkpoint": "m", "prompt_data": "d.jsonl", "num_rollout": 1, "rollout_batch_size": 2,
        "n_samples_per_prompt": 2}


def test_both_backends_take_context_parallelism():
    assert parse_spec({**BASE, "train_backend": "megatron", "context_parallel_size": 2}).context_parallel_size == 2
    for backend in ("megatron", "fsdp"):  # slime's argv: megatron by default
        spec = parse_spec({"slime_args": "--hf-checkpoint m --prompt-data d.jsonl --num-rollout 1 "
                                         f"--rollout-batch-size 2 --context-parallel-size 2 --train-backend {backend}"})
        assert (spec.train_backend, spec.context_parallel_size) == (backend, 2)


def test_a_custom_loss_is_refused_under_context_parallelism(monkeypatch):
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "my_losses")
    with pytest.raises(InvalidArgument, match="custom loss takes the whole packed row's logits"):
        parse_spec({**BASE, "context_parallel_size": 2, "loss_type": "custom_loss",
                    "custom_loss_function_path": "my_losses.loss"})


def test_the_layout_is_checked_against_the_trainers_ranks(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = {**BASE, "prompt_data": str(tmp_path / "d.jsonl")}
    spec = parse_spec({**base, "context_parallel_size": 2})
    assert preflight(spec, world_size=4) is spec  # 2 data-parallel shares of 2 ranks
    with pytest.raises(InvalidArgument, match=r"context_parallel_size 2 must divide the trainer's 3 ranks"):
        preflight(spec, world_size=3)
    # 4 samples a step: two data-parallel shares of one group of 2 each under CP 2, but 4 shares under CP 1
    with pytest.raises(InvalidArgument, match=r"global_batch_size \(4\) must be a multiple of the data-parallel "
                                              r"ranks × n_samples_per_prompt \(4 ranks / context_parallel_size 1"):
        preflight(parse_spec(base), world_size=4)


def test_a_model_whose_layers_are_not_all_full_attention_is_refused_at_submit(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    qwen3 = {"model_type": "qwen3", "layer_types": ["full_attention"] * 2, "use_sliding_window": False}
    # Qwen3.5: gated delta nets mix tokens outside attention (its text_config holds the layers)
    qwen3_5 = {"model_type": "qwen3_5", "text_config": {"layer_types": ["linear_attention", "full_attention"]}}
    for name, config in (("qwen3", qwen3), ("qwen3_5", qwen3_5), ("windowed", {**qwen3, "use_sliding_window": True})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    check = preflight_checks.check_model_family

    def spec(name: str, cp: int = 2):
        return parse_spec({**BASE, "hf_checkpoint": str(tmp_path / name), "prompt_data": str(tmp_path / "d.jsonl"),
                           "context_parallel_size": cp})

    assert check(spec("qwen3")) == []
    assert check(spec("qwen3_5")) == ["context_parallel_size 2: hf_checkpoint's model cannot be split over ranks "
                                      "(its linear_attention layers are not full attention); use "
                                      "context_parallel_size 1"]
    assert check(spec("windowed")) == ["context_parallel_size 2: hf_checkpoint's model cannot be split over ranks "
                                       "(its attention has a sliding window); use context_parallel_size 1"]
    assert check(spec("qwen3_5", cp=1)) == []
    # megatron's gated delta-nets gather each sequence over the CP group: only a sliding window stays refused there
    from services.trainer.models import families

    assert families.context_parallel_problem(qwen3_5, gathers_gated_delta_nets=True) == ""
    assert families.context_parallel_problem({"model_type": "qwen3_next"}, gathers_gated_delta_nets=True) == ""
    assert families.context_parallel_problem({"model_type": "qwen3_next"}) == \
        "its gated delta-net (linear_attention) layers are not full attention"
    assert families.context_parallel_problem({**qwen3, "use_sliding_window": True}, gathers_gated_delta_nets=True)


def test_megatron_refuses_glm5_and_vision_language_models_at_submit_with_the_backends_own_reason(tmp_path):
    """GLM-5's sparse attention and a vision-language model's forward take whole sequences on megatron: refused at
    submit under context parallelism, with the reason the backend gives when it builds the model (one source)."""
    from services.trainer.backends.megatron.backend import _context_parallel_problem
    from services.trainer.models import families
    from services.trainer.settings.train import TrainConfig

    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    text = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "num_hidden_layers": 2, "vocab_size": 256, "rope_parameters": {"rope_theta": 10000.0,
                                                                           "mrope_section": [2, 3, 3]}}
    vision = {"vision_config": {"depth": 2}, "image_token_id": 5}
    configs = {"glm5": {"model_type": "glm_moe_dsa"}, "qwen2_5_vl": {"model_type": "qwen2_5_vl", **vision, **text},
               "qwen3_5": {"model_type": "qwen3_5", **vision, "text_config": {"layer_types": ["full_attention"]}}}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))

    def refusals(name: str, backend: str, **extra) -> list[str]:
        spec = parse_spec({**BASE, "hf_checkpoint": str(tmp_path / name), "prompt_data": str(tmp_path / "d.jsonl"),
                           "context_parallel_size": 2, "train_backend": backend, **extra})
        return [p for p in preflight_checks.check_model_family(spec) if "cannot be split" in p]

    dsa = families.megatron_context_parallel_problem(configs["glm5"])
    whole = families.megatron_context_parallel_problem(configs["qwen2_5_vl"])
    assert dsa == "megatron-core's DeepSeek sparse attention (GLM-5) does not split sequences over ranks"
    assert whole == ("a vision-language model's forward runs each sequence whole on one rank (its multimodal "
                     "positions)")
    for name, reason in (("glm5", dsa), ("qwen2_5_vl", whole)):
        assert refusals(name, "megatron") == [f"context_parallel_size 2: hf_checkpoint's model cannot be split over "
                                              f"ranks ({reason}); use context_parallel_size 1"]
    # Qwen3.5 is a vision-language model only for a job with images (which refuses context parallelism on any
    # backend); a text job trains its language model, which megatron splits
    assert refusals("qwen3_5", "megatron") == []
    assert families.megatron_context_parallel_problem(configs["qwen3_5"], images=True) == whole
    # the backend's own check, when it builds the model, gives the same reasons
    assert _context_parallel_problem(TrainConfig(), configs["glm5"]) == dsa
    assert _context_parallel_problem(TrainConfig(multimodal_keys={"image": "images"}), configs["qwen3_5"]) == whole
    assert _context_parallel_problem(TrainConfig(), configs["qwen3_5"]) == ""
